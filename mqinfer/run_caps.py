"""The cost cap of `mqinfer run` (``--max-cost-usd``): set for its workers, reported, and carried on.

The workers enforce the cap (``mqinfer.workers.queue.job_caps``) from the job's cost hash, which the run
fills before it submits: the cap, and the job's spend so far from its ``request`` cost rows on disk
(the run's embedded server starts empty each time). The requests the cap stopped end with
``budget_exceeded`` rows; the next run of the job removes those rows and computes the requests again,
under its own cap if it has one.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from mqinfer.config import ConfigError
from mqinfer.schemas import keys
from mqinfer.schemas.dataset import COSTS_DIR, RESULTS_DIR
from mqinfer.schemas.dataset_uri import job_table
from mqinfer.schemas.errors import BUDGET_EXCEEDED


def check_cap(cap: float | None) -> None:
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise ConfigError(f"--max-cost-usd must be a number of USD > 0, got {cap}")


def stopped_by_cap(out: Path | str, job_id: str) -> set[str]:
    """Requests of the job whose rows say ``budget_exceeded``: a cost cap (or budget) stopped them
    before they ran."""
    table = job_table(out, RESULTS_DIR, job_id, ["id", "error_code"])
    if table is None:
        return set()
    return {r["id"] for r in table.to_pylist() if r["error_code"] == BUDGET_EXCEEDED}


def job_spend(out: Path | str, job_id: str) -> float:
    """What the job's requests cost so far: the sum of its ``request`` cost rows."""
    import pyarrow.compute as pc

    table = job_table(out, COSTS_DIR, job_id, ["cost_usd"], kind="request")
    if table is None:
        return 0.0
    return float(pc.sum(table["cost_usd"], min_count=0).as_py() or 0.0)


def set_cost_cap(client, out: Path | str, job_id: str, cap: float | None) -> None:
    """The job's cost cap for its workers, with its spend so far; without a cap, none (not even
    one an earlier run left on a server given with --redis)."""
    from mqinfer.workers.queue.job_caps import set_cap

    if cap is None:
        client.delete(keys.job_cost(job_id))
        return
    spent = job_spend(out, job_id)
    set_cap(client, job_id, cap, spent_usd=spent)
    print(f"job {job_id}: cost cap ${cap:g} (--max-cost-usd), ${spent:.6f} spent before this run",
          file=sys.stderr, flush=True)


def cap_summary(stopped: int, cap: float | None) -> str | None:
    """The summary line of a run some of whose requests a cost cap stopped; None when none was."""
    if not stopped:
        return None
    why = f"the job reached its cost cap of ${cap:g} (--max-cost-usd)" if cap is not None else "a budget"
    return (f"cost cap: {stopped} request{'s' if stopped != 1 else ''} did not run ({BUDGET_EXCEEDED}): {why}; "
            "run the same command again with a higher --max-cost-usd to carry on")


__all__ = ["cap_summary", "check_cap", "job_spend", "set_cost_cap", "stopped_by_cap"]
