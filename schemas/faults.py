"""Named fault-injection points for tests: faults the operating system cannot produce for root.

Off unless the environment variable ``MQINFER_FAULTS`` is set, which only tests do:
``MQINFER_FAULTS="point=action[@N],..."`` with actions ``kill`` (SIGKILL this process), ``segv``
(SIGSEGV, as a crash in native code ends a process),
``enospc`` (raise ``OSError(ENOSPC)``), ``eio`` (raise ``OSError(EIO)``) or ``sleep:S``; ``@N``
fires on the N-th time the point is reached (default: the first), and only then; ``@*`` fires
every time (a disk that stays full).

Points: ``sink.before_rename`` (a Parquet part file of either dataset is written and fsynced
under its temporary name), ``sink.results.before_rename`` and ``sink.costs.before_rename`` (the
same, for one dataset only), ``sink.after_write`` (rows are durable, before the ack),
``worker.after_step`` (each engine step), ``worker.admit.<id>`` (a worker hands the request
``id`` to its engine: a request that crashes whichever worker runs it), ``tp.rank_step`` (each step of a tensor-parallel
rank other than 0, before it runs the model), ``pp.stage_step.<s>`` (each step of pipeline stage
``s`` on its ranks other than rank 0, after its first micro-batch), ``compact.<step>`` (each step of compaction, as
:func:`mqinfer.ops.compact.compact` names them: ``temp_written``, ``journal_written``,
``rename:<i>``, ``delete:<i>``, and ``recover:...`` while finishing an interrupted run),
``kv_tier.disk_write`` (each write of a block file of a directory KV tier).
The fault suite in ``tests/faults/`` and ``RELIABILITY.md`` show each one in use.
"""

from __future__ import annotations

import errno
import os
import signal
import time

_plan: dict[str, tuple[str, int]] | None = None
_hits: dict[str, int] = {}


def _load() -> dict[str, tuple[str, int]]:
    global _plan
    if _plan is None:
        _plan = {}
        for part in filter(None, (p.strip() for p in os.environ.get("MQINFER_FAULTS", "").split(","))):
            point, _, action = part.partition("=")
            action, _, nth = (action or "kill").partition("@")
            _plan[point] = (action, 0 if nth == "*" else int(nth or 1))
    return _plan


def enabled() -> bool:
    return bool(_load())


def hit(point: str) -> None:
    """Reach a named point: does nothing unless a test armed it."""
    plan = _load()
    if not plan or point not in plan:
        return
    action, nth = plan[point]
    _hits[point] = _hits.get(point, 0) + 1
    if nth and _hits[point] != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "segv":
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # no Python fault handler: end as a crash does
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
    elif action == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {point})")
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    else:
        raise ValueError(f"MQINFER_FAULTS: unknown action {action!r} for {point}")
