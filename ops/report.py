"""Cost reports from the costs dataset: what each tenant (model, job, ...) used and paid.

:func:`cost_report` reads ``DIR/costs`` (optionally a ``finished_at`` window) and returns a
:class:`Report`; ``ops/report_render.py`` turns it into an aligned table, CSV or JSON, and draws
PNG charts when matplotlib is installed; ``ops/report_html.py`` a self-contained HTML page. The
rows come from one output folder or several, local or behind a filesystem URI
(``ops/report_sources.py``).

* **Groups** (``--by`` any of tenant, model, request_type, job_id, worker, model_variant, a
  request's metadata label ``metadata.KEY``, and the length bands ``prompt_band`` and
  ``output_band``: ops/report_keys.py) sum the ``request`` rows only: requests, prompt (input)
  and output tokens, device seconds and their prefill / decode / recomputed split, KV
  block-seconds, dollars, and dollars per million tokens: all tokens, input tokens (the prefill
  share of the cost) and output tokens (the decode share).
* **Totals**, the same lines in every format: ``billed`` (the ``request`` rows, what the groups
  add up to), ``overhead`` (the ``startup``, ``idle`` and ``lost`` rows; ``lost``: the time a
  killed worker used and never wrote), ``duplicate`` (cost rows of
  results that compaction discarded) and ``TOTAL`` (every row: the three lines added up). Only
  ``billed`` is charged to anyone; the others are the fleet's time that went to no one. Each
  kind's share of all device time is listed too.
* **The most expensive requests**, and **a series per hour** (of ``finished_at``; an idle row
  counts in the hour it was written, though it may cover time before it).
* **Budgets** (``ops/budgets.py``): each budgeted group's spend (tenants, jobs, ``metadata.KEY =
  VALUE`` groups) in the window, per budget period, the warning thresholds it reached and whether
  it reached its budget; groups keyed by a budgeted key are marked.

A request with ``n`` > 1 choices has a ``request`` row per choice (``index``); it counts as one
request (its choice-0 row), and its tokens and cost are those of every choice.

Read the dataset after ``mqinfer compact``: before it, a retried request's cost rows are all
still ``request`` and the report counts each of them as a request. The report counts the
requests with more than one ``request`` row (:func:`uncompacted_warning` words it) instead of
guessing which row to keep. Needs pyarrow only (matplotlib for charts), no torch.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from mqinfer.ops.allocation import BASES, OVERHEAD_KINDS, allocate_overhead
from mqinfer.ops.budgets import Budgets, BudgetStatus, check_groups
from mqinfer.ops.report_keys import checked_by, with_group_columns
from mqinfer.ops.report_series import CostBin, GroupHour, cost_distribution, group_hours
from mqinfer.ops.report_sources import as_sources, is_uri, read_costs
from mqinfer.schemas.rows import COST_KINDS, COST_SCHEMA, with_choice_index, with_device_share

# Of the cached prompt tokens, those each KV tier below the device cache served.
TIER_TOKEN_FIELDS = ("host_cached_tokens", "disk_cached_tokens", "shared_cached_tokens")
_SUMMED = ("prompt_tokens", "cached_prompt_tokens", *TIER_TOKEN_FIELDS, "output_tokens", "rejected_tokens", "device_s", "prefill_s", "decode_s",
           "recomputed_s", "kv_block_s", "cost_usd", "input_usd")
# A group's fields, in the order the renderers (ops/report_render.py) write them.
GROUP_FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", *TIER_TOKEN_FIELDS, "output_tokens", "rejected_tokens", "device_s",
                "prefill_s",
                "decode_s", "recomputed_s", "kv_block_s", "cost_usd", "usd_per_1m_tokens",
                "usd_per_1m_input_tokens", "usd_per_1m_output_tokens")
# The group columns of the text table (CSV and JSON have every field).
TABLE_FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", "output_tokens", "device_s", "cost_usd",
                "usd_per_1m_input_tokens", "usd_per_1m_output_tokens", "usd_per_1m_tokens")
# Shorter headers of the text table's columns.
TABLE_HEADERS = {"usd_per_1m_input_tokens": "usd_per_1m_in", "usd_per_1m_output_tokens": "usd_per_1m_out",
                 "allocated_usd": "alloc_usd", "host_cached_tokens": "host_cached", "disk_cached_tokens": "disk_cached",
                 "shared_cached_tokens": "shared_cached"}
DEFAULT_TOP = 10


@dataclass
class GroupCost:
    """The billed (``request``) rows of one group, summed."""

    key: dict[str, str | None]
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    device_s: float
    cost_usd: float
    # cost_usd per million prompt + output tokens; None when the group has no tokens.
    usd_per_1m_tokens: float | None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_s: float = 0.0
    kv_block_s: float = 0.0
    # Speculative decoding's proposed tokens that were computed and rejected (billed in device_s).
    rejected_tokens: int = 0
    # Of cached_prompt_tokens, those the KV tiers below the device cache served (--kv-host-cache-gib,
    # --kv-disk-cache, --kv-shared-cache).
    host_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    shared_cached_tokens: int = 0
    # The prefill share of cost_usd per million prompt tokens, the decode share per million
    # output tokens; None without such tokens.
    usd_per_1m_input_tokens: float | None = None
    usd_per_1m_output_tokens: float | None = None
    # With budgets and a budgeted key (tenant, job_id, metadata.KEY) among the group's keys: whether
    # one of its budgeted groups reached its budget (None: none has a budget), and the highest
    # warning threshold (percent) one reached (None: none reached).
    over_budget: bool | None = None
    budget_threshold: float | None = None
    # ``--basis allocation``: the group's share of the overhead of the worker-hours it used
    # (ops/allocation.py), and cost_usd plus that share. 0 and cost_usd under ``usage``.
    allocated_device_s: float = 0.0
    allocated_usd: float = 0.0
    total_usd: float | None = None


@dataclass
class Spend:
    """Device seconds and dollars of some cost rows."""

    device_s: float = 0.0
    cost_usd: float = 0.0


def _no_requests() -> GroupCost:
    return GroupCost(key={}, requests=0, prompt_tokens=0, cached_prompt_tokens=0, output_tokens=0, device_s=0.0,
                     cost_usd=0.0, usd_per_1m_tokens=None)


@dataclass
class Totals:
    """The whole window: ``device_s`` and ``cost_usd`` (the TOTAL line) are every row's,
    and equal ``billed`` + ``overhead`` + ``duplicate``."""

    # The billed requests' counts, tokens and prices per token: the same as in ``billed``.
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    rejected_tokens: int = 0
    host_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    shared_cached_tokens: int = 0
    usd_per_1m_tokens: float | None = None
    usd_per_1m_input_tokens: float | None = None
    usd_per_1m_output_tokens: float | None = None
    # Device seconds and dollars of every row.
    device_s: float = 0.0
    cost_usd: float = 0.0
    # The ``request`` rows summed like a group (key {}): what the groups add up to.
    billed: GroupCost = field(default_factory=_no_requests)
    # ``startup`` + ``idle`` + ``lost`` rows, and ``duplicate`` rows: time that bills nobody.
    overhead: Spend = field(default_factory=Spend)
    # ``--basis allocation``: the part of ``overhead`` spread over the groups, and the rest
    # (worker-hours in which no request ran).
    allocated: Spend = field(default_factory=Spend)
    unallocated: Spend = field(default_factory=Spend)
    duplicate: Spend = field(default_factory=Spend)
    # Per kind (request, idle, startup, duplicate, lost).
    device_s_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))
    cost_usd_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))
    # Each kind's fraction of all device seconds (0 when there are none).
    device_share_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))


@dataclass
class RequestCost:
    """One billed request row (for the most expensive requests)."""

    job_id: str | None
    id: str | None
    tenant: str | None
    model: str | None
    request_type: str | None
    worker: str
    prompt_tokens: int
    output_tokens: int
    device_s: float
    cost_usd: float
    finished_at: str  # ISO 8601, UTC


@dataclass
class HourCost:
    """Every row finished within one UTC hour."""

    hour: str  # start of the hour, ISO 8601, UTC
    requests: int
    prompt_tokens: int
    output_tokens: int
    cost_usd: float  # every kind
    billed_usd: float  # request rows only
    device_s_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))


@dataclass
class Report:
    by: list[str]
    since: float | None
    until: float | None
    groups: list[GroupCost]
    totals: Totals
    top_requests: list[RequestCost] = field(default_factory=list)
    hourly: list[HourCost] = field(default_factory=list)
    # None when no budgets were given.
    budgets: list[BudgetStatus] | None = None
    # The billed cost of each group per hour, and how many requests cost how much (charts).
    hourly_by_group: list[GroupHour] = field(default_factory=list)
    cost_distribution: list[CostBin] = field(default_factory=list)
    # Whether the groups carry budget marks (over_budget, budget_threshold): budgets were given and
    # ``by`` has a key they budget (tenant, job_id, metadata.KEY).
    budget_marks: bool = False
    # Requests (job_id, id) with more than one ``request`` cost row in the window, and how many
    # rows beyond one each they have: both 0 after ``mqinfer compact``.
    requests_counted_more_than_once: int = 0
    extra_request_rows: int = 0
    # "usage" (requests pay for their own device time) or "allocation" (also for the overhead
    # of the worker-hours they used).
    basis: str = "usage"


def _per_million(cost: float, tokens: int) -> float | None:
    return cost / tokens * 1_000_000 if tokens else None


def cost_report(
    out_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    by: Sequence[str] = ("tenant",),
    since: float | None = None,
    until: float | None = None,
    *,
    top: int = DEFAULT_TOP,
    budgets: Budgets | None = None,
    basis: str = "usage",
) -> Report:
    """Sum the costs dataset under ``out_dir`` by the ``by`` columns: one output folder or
    several (their rows together), each a local path or a pyarrow filesystem URI
    (ops/report_sources.py).

    ``since`` (inclusive) and ``until`` (exclusive) bound ``finished_at``, in unix seconds.
    Groups are ordered by cost, highest first; ``top`` is how many of the most expensive
    requests to list. ``basis`` ``allocation`` also spreads the startup, idle and lost time over the
    groups (ops/allocation.py), and orders them by cost plus that share.
    """
    if basis not in BASES:
        raise ValueError(f"unknown cost basis {basis!r}: use one of {', '.join(BASES)}")
    by = checked_by(by)
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    if since is not None and until is not None and until <= since:
        raise ValueError(f"empty time window: until ({until}) must be after since ({since})")
    table = with_group_columns(_with_input_cost(_read_costs(as_sources(out_dir), since, until)), by)

    totals = _totals_by_kind(table)
    billed = table.filter(pc.equal(table["kind"], "request"))
    groups = _ranked_groups(table, billed, by, basis, totals)
    _add_billed(totals, billed)
    counted_twice, extra_rows = _repeated_requests(billed)
    statuses = None
    if budgets is not None:
        statuses = _budget_statuses(budgets, with_group_columns(billed, budgets.keys()), by, groups)
    return Report(by=by, since=since, until=until, groups=groups, totals=totals,
                  top_requests=_top_requests(billed, top), hourly=_hourly(table), budgets=statuses,
                  requests_counted_more_than_once=counted_twice, extra_request_rows=extra_rows, basis=basis,
                  budget_marks=budgets is not None and any(k in budgets.keys() for k in by),
                  hourly_by_group=group_hours(billed, by), cost_distribution=cost_distribution(billed))


def _totals_by_kind(table: pa.Table) -> Totals:
    """``Totals`` with every row's device seconds and dollars: per kind, in all, and the overhead
    and duplicate lines (the billed line comes from ``_add_billed``)."""
    totals = Totals()
    if table.num_rows:
        per_kind = table.group_by("kind", use_threads=False).aggregate([("device_s", "sum"), ("cost_usd", "sum")])
        for row in per_kind.to_pylist():
            totals.device_s_by_kind[row["kind"]] = row["device_s_sum"]
            totals.cost_usd_by_kind[row["kind"]] = row["cost_usd_sum"]
    totals.device_s = sum(totals.device_s_by_kind.values())
    totals.cost_usd = sum(totals.cost_usd_by_kind.values())
    if totals.device_s > 0:
        totals.device_share_by_kind = {k: v / totals.device_s for k, v in totals.device_s_by_kind.items()}
    totals.overhead = Spend(
        device_s=sum(totals.device_s_by_kind[k] for k in OVERHEAD_KINDS),
        cost_usd=sum(totals.cost_usd_by_kind[k] for k in OVERHEAD_KINDS),
    )
    totals.duplicate = Spend(device_s=totals.device_s_by_kind["duplicate"],
                             cost_usd=totals.cost_usd_by_kind["duplicate"])
    return totals


def _ranked_groups(table: pa.Table, billed: pa.Table, by: list[str], basis: str, totals: Totals) -> list[GroupCost]:
    """The ``billed`` rows summed by ``by``, ordered by cost (with ``basis`` ``allocation``: cost
    plus the group's share of the overhead in ``table``, the shares' sums going into ``totals``)."""
    groups = [_group(key_row, by) for key_row in _aggregate(billed, by)]
    for g in groups:
        g.total_usd = g.cost_usd
    if basis == "allocation":
        spread = allocate_overhead(table, by)
        for g in groups:
            key = tuple(g.key[k] for k in by)
            g.allocated_device_s, g.allocated_usd = spread.device_s.get(key, 0.0), spread.cost_usd.get(key, 0.0)
            g.total_usd = g.cost_usd + g.allocated_usd
        totals.allocated = Spend(device_s=sum(spread.device_s.values()), cost_usd=sum(spread.cost_usd.values()))
        totals.unallocated = Spend(device_s=spread.unallocated_device_s, cost_usd=spread.unallocated_usd)
    groups.sort(key=lambda g: (-g.total_usd, [(v is None, v or "") for v in g.key.values()]))
    return groups


def _add_billed(totals: Totals, billed: pa.Table) -> None:
    """The billed line of ``totals`` (every ``request`` row as one group, with the overhead
    allocated to the groups), and the request counts, tokens and prices per token it shares."""
    b = totals.billed = _billed_sum(billed)
    b.allocated_device_s, b.allocated_usd = totals.allocated.device_s, totals.allocated.cost_usd
    b.total_usd = b.cost_usd + b.allocated_usd
    totals.requests, totals.prompt_tokens = b.requests, b.prompt_tokens
    totals.cached_prompt_tokens, totals.output_tokens = b.cached_prompt_tokens, b.output_tokens
    totals.rejected_tokens = b.rejected_tokens
    for name in TIER_TOKEN_FIELDS:
        setattr(totals, name, getattr(b, name))
    totals.usd_per_1m_tokens = b.usd_per_1m_tokens
    totals.usd_per_1m_input_tokens = b.usd_per_1m_input_tokens
    totals.usd_per_1m_output_tokens = b.usd_per_1m_output_tokens


def _budget_statuses(budgets: Budgets, billed: pa.Table, by: list[str], groups: list[GroupCost]) -> list[BudgetStatus]:
    """Each budgeted group's spend in the window against its budget; with groups keyed by a
    budgeted key, each group marked with whether one of its budgeted groups reached its budget
    and the highest threshold reached."""
    statuses = check_groups(budgets, _spend_by_period(billed, budgets))
    status = {(s.key, s.value): s for s in statuses}
    keys = [k for k in by if k in budgets.keys()]
    if keys:
        for g in groups:
            mine = [status.get((k, (g.key[k] or "default") if k == "tenant" else g.key[k])) for k in keys]
            mine = [s for s in mine if s is not None]
            if mine:
                g.over_budget = any(s.over for s in mine)
                g.budget_threshold = max((t for s in mine for t in s.thresholds_reached), default=None)
    return statuses


def uncompacted_warning(report: Report, out_dir: str | os.PathLike[str] | Sequence[str]) -> str | None:
    """One line for stderr when some request has several ``request`` cost rows; else None."""
    n = report.requests_counted_more_than_once
    if not n:
        return None
    folders = " ".join(as_sources(out_dir))
    return (f"warning: {n} request{'s are' if n != 1 else ' is'} counted more than once "
            f"({report.extra_request_rows} extra `request` cost row{'s' if report.extra_request_rows != 1 else ''}): "
            f"{folders} {'has' if ' ' not in folders else 'have'} not been compacted; "
            f"run `mqinfer compact {folders}` first")


def _read_costs(sources, since: float | None, until: float | None) -> pa.Table:
    """Every cost row of ``sources`` (one output folder or several) finished in the window."""
    sources = as_sources(sources)
    condition = None
    ts_type = COST_SCHEMA.field("finished_at").type
    if since is not None:
        condition = ds.field("finished_at") >= pa.scalar(round(since * 1_000_000), ts_type)
    if until is not None:
        upper = ds.field("finished_at") < pa.scalar(round(until * 1_000_000), ts_type)
        condition = upper if condition is None else condition & upper
    return with_choice_index(with_device_share(read_costs(sources, condition)), COST_SCHEMA)


def _with_input_cost(table: pa.Table) -> pa.Table:
    """Add ``input_usd``: each row's cost times its prefill share of device time."""
    device = table["device_s"]
    share = pc.if_else(pc.greater(device, 0.0), pc.divide(table["prefill_s"], device), 0.0)
    return table.append_column("input_usd", pc.multiply(table["cost_usd"], share))


def _aggregate(billed: pa.Table, by: list[str]) -> list[dict]:
    if not billed.num_rows:
        return []
    return _with_first_choice(billed).group_by(by, use_threads=False).aggregate(
        [("first_choice", "sum")] + [(name, "sum") for name in _SUMMED]
    ).to_pylist()


def _billed_sum(billed: pa.Table) -> GroupCost:
    """Every ``request`` row summed as one group with no key."""
    row = {f"{name}_sum": pc.sum(billed[name], min_count=0).as_py() for name in _SUMMED}
    requests = pc.sum(_with_first_choice(billed)["first_choice"], min_count=0).as_py() or 0
    return _group(row | {"first_choice_sum": requests}, [])


def _first_choice(table: pa.Table) -> pa.ChunkedArray:
    """Whether each row is a request's first (or only) choice: one per request."""
    return pc.equal(pc.fill_null(table["index"], pa.scalar(0, pa.int32())), 0)


def _with_first_choice(billed: pa.Table) -> pa.Table:
    """``billed`` with ``first_choice`` (1 for a request's choice-0 row, else 0), which counts requests."""
    return billed.append_column("first_choice", pc.cast(_first_choice(billed), pa.int64()))


def _repeated_requests(billed: pa.Table) -> tuple[int, int]:
    """How many (job_id, id, index) have more than one ``request`` row, and their rows beyond the first.

    Before compaction every attempt of a retried request still bills as ``request``; after it
    at most one row per request does.
    """
    keyed = billed.filter(pc.is_valid(billed["id"]))
    if not keyed.num_rows:
        return 0, 0
    counts = keyed.group_by(["job_id", "id", "index"], use_threads=False).aggregate([("kind", "count")])["kind_count"]
    repeated = counts.filter(pc.greater(counts, 1))
    return len(repeated), (pc.sum(repeated).as_py() or 0) - len(repeated)


def _group(row: dict, by: list[str]) -> GroupCost:
    s = {name: row[f"{name}_sum"] for name in _SUMMED}
    return GroupCost(
        key={k: row[k] for k in by},
        requests=row["first_choice_sum"],
        prompt_tokens=s["prompt_tokens"],
        cached_prompt_tokens=s["cached_prompt_tokens"],
        output_tokens=s["output_tokens"],
        device_s=s["device_s"],
        cost_usd=s["cost_usd"],
        usd_per_1m_tokens=_per_million(s["cost_usd"], s["prompt_tokens"] + s["output_tokens"]),
        prefill_s=s["prefill_s"],
        decode_s=s["decode_s"],
        recomputed_s=s["recomputed_s"],
        kv_block_s=s["kv_block_s"],
        # Rows written before the column existed read as null.
        rejected_tokens=s["rejected_tokens"] or 0,
        host_cached_tokens=s["host_cached_tokens"] or 0,
        disk_cached_tokens=s["disk_cached_tokens"] or 0,
        shared_cached_tokens=s["shared_cached_tokens"] or 0,
        usd_per_1m_input_tokens=_per_million(s["input_usd"], s["prompt_tokens"]),
        usd_per_1m_output_tokens=_per_million(s["cost_usd"] - s["input_usd"], s["output_tokens"]),
    )


def _iso(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _top_requests(billed: pa.Table, top: int) -> list[RequestCost]:
    if not top or not billed.num_rows:
        return []
    ranked = billed.sort_by([("cost_usd", "descending"), ("finished_at", "ascending")]).slice(0, top)
    return [
        RequestCost(job_id=r["job_id"], id=r["id"], tenant=r["tenant"], model=r["model"],
                    request_type=r["request_type"], worker=r["worker"], prompt_tokens=r["prompt_tokens"],
                    output_tokens=r["output_tokens"], device_s=r["device_s"], cost_usd=r["cost_usd"],
                    finished_at=_iso(r["finished_at"]))
        for r in ranked.to_pylist()
    ]


def _hourly(table: pa.Table) -> list[HourCost]:
    if not table.num_rows:
        return []
    is_request = pc.equal(table["kind"], "request")
    zero = pa.scalar(0, pa.int32())
    hours = pa.table({
        "hour": pc.floor_temporal(table["finished_at"], unit="hour"),
        "kind": table["kind"],
        "device_s": table["device_s"],
        "cost_usd": table["cost_usd"],
        "requests": pc.cast(pc.and_(is_request, _first_choice(table)), pa.int64()),
        "prompt_tokens": pc.if_else(is_request, table["prompt_tokens"], zero),
        "output_tokens": pc.if_else(is_request, table["output_tokens"], zero),
    })
    agg = hours.group_by(["hour", "kind"], use_threads=False).aggregate(
        [(name, "sum") for name in ("device_s", "cost_usd", "requests", "prompt_tokens", "output_tokens")]
    )
    series: dict[dt.datetime, HourCost] = {}
    for row in agg.to_pylist():
        h = series.get(row["hour"])
        if h is None:
            h = series[row["hour"]] = HourCost(hour=_iso(row["hour"]), requests=0, prompt_tokens=0, output_tokens=0,
                                               cost_usd=0.0, billed_usd=0.0)
        h.device_s_by_kind[row["kind"]] = row["device_s_sum"]
        h.cost_usd += row["cost_usd_sum"]
        h.requests += row["requests_sum"]
        h.prompt_tokens += row["prompt_tokens_sum"]
        h.output_tokens += row["output_tokens_sum"]
        if row["kind"] == "request":
            h.billed_usd += row["cost_usd_sum"]
    return [series[k] for k in sorted(series)]


def _spend_by_period(billed: pa.Table, budgets: Budgets) -> dict[tuple[str, str, str], float]:
    """Spend by (group key, value, period) for every key the budgets name (``billed`` has a
    column per key: with_group_columns)."""
    if not billed.num_rows:
        return {}
    if budgets.period == "total":
        period = pa.array([""] * billed.num_rows, pa.string())
    else:
        period = pc.strftime(billed["finished_at"], format="%Y-%m" if budgets.period == "month" else "%Y-%m-%d")
    out: dict[tuple[str, str, str], float] = {}
    for key in budgets.keys():
        values = pc.fill_null(billed[key], "default") if key == "tenant" else billed[key]
        spend = pa.table({"value": values, "period": period, "cost_usd": billed["cost_usd"]})
        spend = spend.filter(pc.is_valid(spend["value"]))
        agg = spend.group_by(["value", "period"], use_threads=False).aggregate([("cost_usd", "sum")])
        out.update({(key, r["value"], r["period"]): r["cost_usd_sum"] for r in agg.to_pylist()})
    return out


def schema_validity(out_dir: str | os.PathLike[str] | Sequence[str]) -> tuple[int, int] | None:
    """(rows whose text validated, rows with a ``response_format``) in the results of the local
    output folders ``out_dir``, from the ``schema_valid`` column (null for rows without one); None
    when there are no results or no row had a ``response_format``."""
    valid = constrained = 0
    for source in as_sources(out_dir):
        root = Path(source) / "results"
        if is_uri(source) or not root.is_dir():
            continue
        dataset = ds.dataset(root, format="parquet", partitioning="hive")
        if not dataset.files or "schema_valid" not in dataset.schema.names:
            continue
        column = dataset.to_table(columns=["schema_valid"])["schema_valid"]
        constrained += len(column) - column.null_count
        valid += sum(1 for v in column.to_pylist() if v)
    return (valid, constrained) if constrained else None

