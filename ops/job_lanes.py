"""The lanes a bulk job's requests go to (the key scheme is :mod:`mqinfer.schemas.lanes`).

A job registers a lane the way every producer does (:meth:`mqinfer.client.Producer.stream_key_for`):
the bounded registration script (past ``max_lanes`` a new lane hashes onto a shared one), the
workers' consumer group at the lane's start, and a notice on the plain stream when the lane is new
or was unused for a while, which wakes a worker blocked reading. Each shard stream of the job has
lanes of its own. A task is short, so what it registered is remembered for the task's life.
"""

from __future__ import annotations

from collections.abc import Sequence

from mqinfer.schemas import lanes as scheme

# Lane modes under which a job has lanes of its own, removed when it ends; a tenant's lane
# (``tenant``) is shared with every other producer of the tenant and stays.
JOB_LANE_MODES = frozenset({"job", "tenant,job"})
# `mqinfer jobs submit`'s default: each job in a lane of its own (per tenant), so that the workers
# read a new job's requests beside the backlog of the jobs before it instead of behind it.
DEFAULT_JOB_LANES = "tenant,job"


class JobLanes:
    """Picks and registers the lane of each request of one job, for one task."""

    def __init__(self, data, streams: Sequence[str], mode: str, max_lanes: int, job_id: str) -> None:
        self.data = data
        self.streams = list(streams)
        self.mode = mode
        self.max_lanes = max_lanes
        self.job_id = job_id
        self._register = data.register_script(scheme.REGISTER_SCRIPT) if mode != "none" else None
        # (shard, lane asked for) -> the lane registered for it (a shared one past the limit).
        self._used: dict[tuple[int, str], str] = {}
        # The job's own lanes registered by this task and not yet handed out by take_new_own().
        self._new_own: list[tuple[int, str]] = []

    @property
    def needs_tenant(self) -> bool:
        """Whether the lane depends on the request's tenant."""
        return self.mode in ("tenant", "tenant,job")

    def lane_for(self, shard: int, tenant: str) -> str | None:
        """The registered lane of shard ``shard``'s stream for a request of ``tenant`` in this job
        (None: the plain stream)."""
        wanted = scheme.lane_name(self.mode, tenant, self.job_id)
        if wanted is None:
            return None
        used = self._used.get((shard, wanted))
        if used is None:
            used = self._register_lane(shard, wanted)
            self._used[(shard, wanted)] = used
            if used == wanted and self.mode in JOB_LANE_MODES:
                self._new_own.append((shard, used))
        return used

    def take_new_own(self) -> list[tuple[int, str]]:
        """The job's own lanes (``job``, ``tenant,job``; not shared ones) registered since the last call."""
        new, self._new_own = self._new_own, []
        return new

    def _register_lane(self, shard: int, lane: str) -> str:
        return scheme.register_lane(self.data, self.streams[shard], lane, self.max_lanes, script=self._register)
