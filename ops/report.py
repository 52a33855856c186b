"""Cost reports from the costs dataset: what each tenant (model, job, ...) used and paid.

Groups sum the ``request`` rows only; ``idle``, ``startup`` and ``duplicate`` rows bill nobody
and appear in the totals, with their share of all device time, so that the report shows how
much of the fleet's time went to no one. Read the dataset after ``mqinfer compact``: before it,
a retried request's cost rows are all still ``request``. Needs pyarrow only, no torch.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from mqinfer.schemas.rows import COST_KINDS, COST_SCHEMA
from mqinfer.workers.sink import COSTS_DIR, part_files

GROUP_KEYS = ("tenant", "model", "request_type", "job_id", "worker")
_SUMMED = ("prompt_tokens", "cached_prompt_tokens", "output_tokens", "device_s", "cost_usd")
_METRICS = ("requests",) + _SUMMED + ("usd_per_1m_tokens",)


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


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    usd_per_1m_tokens: float | None = None
    # Device seconds and dollars of every row, and per kind (request, idle, startup, duplicate).
    device_s: float = 0.0
    cost_usd: float = 0.0
    device_s_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))
    cost_usd_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))
    # Each kind's fraction of all device seconds (0 when there are none).
    device_share_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_KINDS, 0.0))


@dataclass
class Report:
    by: list[str]
    since: float | None
    until: float | None
    groups: list[GroupCost]
    totals: Totals


def _per_million(cost: float, tokens: int) -> float | None:
    return cost / tokens * 1_000_000 if tokens else None


def cost_report(
    out_dir: str | os.PathLike[str],
    by: Sequence[str] = ("tenant",),
    since: float | None = None,
    until: float | None = None,
) -> Report:
    """Sum the costs dataset under ``out_dir`` by the ``by`` columns.

    ``since`` (inclusive) and ``until`` (exclusive) bound ``finished_at``, in unix seconds.
    Groups are ordered by cost, highest first.
    """
    if isinstance(by, str):
        by = [by]
    by = list(by)
    bad = [key for key in by if key not in GROUP_KEYS]
    if bad or not by or len(set(by)) != len(by):
        raise ValueError(f"cannot group costs by {by!r}: use one or more distinct keys of {', '.join(GROUP_KEYS)}")
    table = _read_costs(Path(out_dir), by, since, until)

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

    billed = table.filter(pc.equal(table["kind"], "request"))
    groups: list[GroupCost] = []
    if billed.num_rows:
        aggregated = billed.group_by(by, use_threads=False).aggregate(
            [("kind", "count")] + [(name, "sum") for name in _SUMMED]
        )
        for row in aggregated.to_pylist():
            tokens = row["prompt_tokens_sum"] + row["output_tokens_sum"]
            groups.append(
                GroupCost(
                    key={k: row[k] for k in by},
                    requests=row["kind_count"],
                    prompt_tokens=row["prompt_tokens_sum"],
                    cached_prompt_tokens=row["cached_prompt_tokens_sum"],
                    output_tokens=row["output_tokens_sum"],
                    device_s=row["device_s_sum"],
                    cost_usd=row["cost_usd_sum"],
                    usd_per_1m_tokens=_per_million(row["cost_usd_sum"], tokens),
                )
            )
    groups.sort(key=lambda g: (-g.cost_usd, [(v is None, v or "") for v in g.key.values()]))
    totals.requests = sum(g.requests for g in groups)
    totals.prompt_tokens = sum(g.prompt_tokens for g in groups)
    totals.cached_prompt_tokens = sum(g.cached_prompt_tokens for g in groups)
    totals.output_tokens = sum(g.output_tokens for g in groups)
    totals.usd_per_1m_tokens = _per_million(
        totals.cost_usd_by_kind["request"], totals.prompt_tokens + totals.output_tokens
    )
    return Report(by=by, since=since, until=until, groups=groups, totals=totals)


def _read_costs(out: Path, by: list[str], since: float | None, until: float | None) -> pa.Table:
    columns = sorted(set(by) | {"kind", *_SUMMED})
    files = part_files(out / COSTS_DIR)
    if not files:
        return pa.table({name: pa.array([], COST_SCHEMA.field(name).type) for name in columns})
    dataset = ds.dataset([str(f) for f in files], format="parquet", schema=COST_SCHEMA)
    condition = None
    ts_type = COST_SCHEMA.field("finished_at").type
    if since is not None:
        condition = ds.field("finished_at") >= pa.scalar(round(since * 1_000_000), ts_type)
    if until is not None:
        upper = ds.field("finished_at") < pa.scalar(round(until * 1_000_000), ts_type)
        condition = upper if condition is None else condition & upper
    return dataset.to_table(columns=columns, filter=condition)


# -- rendering ------------------------------------------------------------------------------


def render(report: Report, fmt: Literal["table", "csv", "json"] = "table") -> str:
    """The report as an aligned text table, CSV (one line per group) or JSON (everything)."""
    if fmt == "json":
        return json.dumps(dataclasses.asdict(report), indent=2) + "\n"
    if fmt == "csv":
        return _render_csv(report)
    if fmt == "table":
        return _render_table(report)
    raise ValueError(f"unknown report format {fmt!r}; expected table, csv or json")


def _render_csv(report: Report) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(report.by + list(_METRICS))
    for g in report.groups:
        w.writerow(
            ["" if g.key[k] is None else g.key[k] for k in report.by]
            + ["" if getattr(g, m) is None else getattr(g, m) for m in _METRICS]
        )
    return buf.getvalue()


def _fmt_number(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "cost_usd":
        return f"{value:.6f}"
    if name == "usd_per_1m_tokens":
        return f"{value:.4f}"
    if name == "device_s":
        return f"{value:.3f}"
    return str(value)


def _render_table(report: Report) -> str:
    headers = report.by + list(_METRICS)
    lines: list[list[str]] = []
    for g in report.groups:
        lines.append(
            ["(none)" if g.key[k] is None else str(g.key[k]) for k in report.by]
            + [_fmt_number(m, getattr(g, m)) for m in _METRICS]
        )
    t = report.totals
    total_values = {
        "requests": t.requests,
        "prompt_tokens": t.prompt_tokens,
        "cached_prompt_tokens": t.cached_prompt_tokens,
        "output_tokens": t.output_tokens,
        "device_s": t.device_s_by_kind["request"],
        "cost_usd": t.cost_usd_by_kind["request"],
        "usd_per_1m_tokens": t.usd_per_1m_tokens,
    }
    lines.append(["TOTAL"] + [""] * (len(report.by) - 1) + [_fmt_number(m, total_values[m]) for m in _METRICS])
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(headers)]
    numeric = [i >= len(report.by) for i in range(len(headers))]

    def fmt_row(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    out = [fmt_row(headers), fmt_row(["-" * w for w in widths])]
    out += [fmt_row(row) for row in lines[:-1]]
    out += [fmt_row(["-" * w for w in widths]), fmt_row(lines[-1])]
    out.append("")
    out.append(f"device time: {t.device_s:.3f} s, cost {t.cost_usd:.6f} USD")
    for kind in COST_KINDS:
        out.append(
            f"  {kind:<10} {t.device_s_by_kind[kind]:>12.3f} s  {100 * t.device_share_by_kind[kind]:6.2f}%"
            f"  {t.cost_usd_by_kind[kind]:.6f} USD"
        )
    return "\n".join(out) + "\n"
