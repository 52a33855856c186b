"""Cost reports rendered: aligned text tables, CSV and JSON (:func:`render`), and PNG charts
(:func:`plot`) of a :class:`~mqinfer.ops.report.Report`. Every format ends with the same summary
lines (``SUMMARY_LINES``)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any, Literal

from mqinfer.ops.report import (GROUP_FIELDS, TABLE_FIELDS, TABLE_HEADERS, TIER_TOKEN_FIELDS, GroupCost, Report, Spend,
                                 Totals)
from mqinfer.schemas.rows import COST_KINDS

# -- rendering ------------------------------------------------------------------------------


# The summary lines under the groups, the same in every format: (CSV ``row`` value, table label).
# ``billed`` has every group field; the others only device_s and cost_usd.
SUMMARY_LINES = (
    ("billed", "billed (requests)"),
    ("overhead", "overhead (startup + idle + lost)"),
    ("duplicate", "duplicate (not billed)"),
    ("total", "TOTAL (every row)"),
)


# With ``--basis allocation``, after ``overhead``: its part spread over the groups and the rest.
ALLOCATION_LINES = (
    ("allocated", "  of it allocated"),
    ("unallocated", "  of it unallocated"),
)
# The group fields ``--basis allocation`` adds (after cost_usd in the text table).
ALLOCATION_FIELDS = ("allocated_device_s", "allocated_usd", "total_usd")
_ALLOCATION_TABLE_FIELDS = ("allocated_usd", "total_usd")


def summary_lines(report: Report) -> tuple[tuple[str, str], ...]:
    """The summary lines under the groups, (name, table label) each, in order."""
    if report.basis != "allocation":
        return SUMMARY_LINES
    return SUMMARY_LINES[:2] + ALLOCATION_LINES + SUMMARY_LINES[2:]


def _group_fields(report: Report) -> tuple[str, ...]:
    return GROUP_FIELDS + (ALLOCATION_FIELDS if report.basis == "allocation" else ())


def table_fields(report: Report) -> tuple[str, ...]:
    """The group columns of the text table (and the HTML page) for this report."""
    fields = TABLE_FIELDS
    if report.totals.rejected_tokens:
        # Speculative decoding ran: the proposed tokens it computed and rejected, after the outputs.
        i = fields.index("output_tokens") + 1
        fields = fields[:i] + ("rejected_tokens",) + fields[i:]
    tiers = tuple(name for name in TIER_TOKEN_FIELDS if getattr(report.totals, name))
    if tiers:
        # KV tiers served prompt tokens: how many from each, after the cached tokens.
        i = fields.index("cached_prompt_tokens") + 1
        fields = fields[:i] + tiers + fields[i:]
    if report.basis == "allocation":
        i = fields.index("cost_usd") + 1
        fields = fields[:i] + _ALLOCATION_TABLE_FIELDS + fields[i:]
    return fields


def summary_by_name(totals: Totals) -> dict[str, GroupCost | Spend]:
    """Each summary line's sums, by its name."""
    return {"billed": totals.billed, "overhead": totals.overhead, "duplicate": totals.duplicate,
            "allocated": totals.allocated, "unallocated": totals.unallocated,
            "total": Spend(device_s=totals.device_s, cost_usd=totals.cost_usd)}


def budget_mark(over: bool | None, threshold: float | None) -> str:
    """A group's budget mark: OVER, the highest warning threshold it reached (``>=80%``), ok, or
    empty when none of its groups has a budget."""
    if over is None:
        return ""
    if over:
        return "OVER"
    return f">={threshold:g}%" if threshold is not None else "ok"


def budget_status(status) -> str:
    """The status column of the budgets table: OVER BUDGET, a warning, or ok."""
    if status.over:
        return "OVER BUDGET"
    if status.thresholds_reached:
        return f"warning: >={status.thresholds_reached[-1]:g}%"
    return "ok"


def render(report: Report, fmt: Literal["table", "csv", "json"] = "table") -> str:
    """The report as aligned text tables, CSV (the groups, then the summary lines) or JSON
    (everything)."""
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
    budget_column = ["over_budget", "budget_threshold"] if report.budget_marks else []
    # ``row`` tells the groups (``group``) from the summary lines (SUMMARY_LINES).
    fields = _group_fields(report)
    w.writerow(["row"] + report.by + list(fields) + budget_column)
    for g in report.groups:
        extra = (["" if g.over_budget is None else str(g.over_budget).lower(),
                  "" if g.budget_threshold is None else g.budget_threshold] if budget_column else [])
        w.writerow(
            ["group"] + ["" if g.key[k] is None else g.key[k] for k in report.by]
            + ["" if getattr(g, m, None) is None else getattr(g, m) for m in fields]
            + extra
        )
    summary = summary_by_name(report.totals)
    for name, _ in summary_lines(report):
        line = summary[name]
        w.writerow([name] + [""] * len(report.by)
                   + ["" if getattr(line, m, None) is None else getattr(line, m) for m in fields]
                   + [""] * len(budget_column))
    return buf.getvalue()


def fmt_number(name: str, value: Any) -> str:
    """A value of the column ``name`` as the tables show it."""
    if value is None:
        return "-"
    if name.startswith("usd_per_1m"):
        return f"{value:.4f}"
    if name.endswith("usd"):
        return f"{value:.6f}"
    if name.endswith("_s"):
        return f"{value:.3f}"
    return str(value)


def _aligned(headers: list[str], rows: list[list[str]], numeric: list[bool],
             footer: list[list[str]] | None = None) -> list[str]:
    every = rows + (footer or [])
    widths = [max(len(h), *(len(r[i]) for r in every)) if every else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    rule = line(["-" * w for w in widths])
    out = [line(headers), rule] + [line(r) for r in rows]
    if footer:
        out += [rule] + [line(r) for r in footer]
    return out


def _render_table(report: Report) -> str:
    budget_column = report.budget_marks
    fields = table_fields(report)
    headers = report.by + [TABLE_HEADERS.get(m, m) for m in fields] + (["budget"] if budget_column else [])
    numeric = [False] * len(report.by) + [True] * len(fields) + ([False] if budget_column else [])
    rows = []
    for g in report.groups:
        mark = [budget_mark(g.over_budget, g.budget_threshold)] if budget_column else []
        rows.append(["(none)" if g.key[k] is None else str(g.key[k]) for k in report.by]
                    + [fmt_number(m, getattr(g, m)) for m in fields] + mark)
    t = report.totals
    summary = summary_by_name(t)
    footer = [[label] + [""] * (len(report.by) - 1)
              + [fmt_number(m, getattr(summary[name], m)) if hasattr(summary[name], m) else ""
                 for m in fields]
              + ([""] if budget_column else []) for name, label in summary_lines(report)]
    out = _aligned(headers, rows, numeric, footer)

    out += ["", "device time by kind (share of the TOTAL):"]
    for kind in COST_KINDS:
        out.append(
            f"  {kind:<10} {t.device_s_by_kind[kind]:>12.3f} s  {100 * t.device_share_by_kind[kind]:6.2f}%"
            f"  {t.cost_usd_by_kind[kind]:.6f} USD"
        )
    if report.top_requests:
        out += ["", f"most expensive requests (top {len(report.top_requests)}):"]
        out += _aligned(
            ["job_id", "id", "tenant", "worker", "prompt_tokens", "output_tokens", "device_s", "cost_usd"],
            [[r.job_id or "(none)", r.id or "", r.tenant or "", r.worker, str(r.prompt_tokens), str(r.output_tokens),
              fmt_number("device_s", r.device_s), fmt_number("cost_usd", r.cost_usd)] for r in report.top_requests],
            [False] * 4 + [True] * 4,
        )
    if report.hourly:
        out += ["", "per hour (UTC):"]
        out += _aligned(
            ["hour", "requests", "prompt_tokens", "output_tokens", *(f"{k}_s" for k in COST_KINDS), "cost_usd"],
            [[h.hour, str(h.requests), str(h.prompt_tokens), str(h.output_tokens)]
             + [fmt_number("device_s", h.device_s_by_kind[k]) for k in COST_KINDS]
             + [fmt_number("cost_usd", h.cost_usd)] for h in report.hourly],
            [False] + [True] * (4 + len(COST_KINDS)),
        )
    if report.budgets is not None:
        out += ["", "budgets:"]
        if report.budgets:
            out += _aligned(
                ["group", "period", "budget_usd", "spent_usd", "remaining_usd", "status"],
                [[s.group, s.period or "total", fmt_number("usd", s.budget_usd), fmt_number("usd", s.spent_usd),
                  fmt_number("usd", s.remaining_usd), budget_status(s)] for s in report.budgets],
                [False, False, True, True, True, False],
            )
        else:
            out.append("  (no group has a budget)")
    return "\n".join(out) + "\n"


# -- charts ---------------------------------------------------------------------------------


def plot(report: Report, directory: str | os.PathLike[str]) -> list[Path]:
    """Write PNG charts of the report into ``directory``; returns their paths.

    ``cost_by_<keys>.png``: billed cost of the 20 most expensive groups;
    ``device_time_per_hour.png``: device seconds per hour, stacked by kind.
    Needs matplotlib (``pip install matplotlib``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("charts need matplotlib, which is not installed: pip install matplotlib") from None
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    groups = report.groups[:20]
    fig = Figure(figsize=(9, 1.5 + 0.35 * max(len(groups), 1)), layout="constrained")
    ax = fig.add_subplot()
    labels = [" / ".join("(none)" if v is None else str(v) for v in g.key.values()) for g in groups]
    positions = list(range(len(groups)))
    ax.barh(positions, [g.cost_usd for g in groups][::-1], color="tab:blue")
    ax.set_yticks(positions, labels[::-1])
    ax.set_xlabel("cost (USD)")
    ax.set_title(f"Billed cost by {', '.join(report.by)}" + (" (top 20)" if len(report.groups) > 20 else ""))
    path = folder / f"cost_by_{'_'.join(report.by)}.png"
    fig.savefig(path, dpi=100)
    written.append(path)

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    # Bars at integer positions with the hours as tick labels (as categories, matplotlib would
    # try to read them as dates).
    positions = list(range(len(report.hourly)))
    bottom = [0.0] * len(positions)
    colors = {"request": "tab:blue", "idle": "tab:gray", "startup": "tab:orange", "duplicate": "tab:red",
              "lost": "tab:purple"}
    for kind in COST_KINDS:
        values = [h.device_s_by_kind[kind] for h in report.hourly]
        ax.bar(positions, values, bottom=bottom, label=kind, color=colors[kind])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(positions, [h.hour[:13].replace("T", " ") + "h" for h in report.hourly], rotation=45, ha="right")
    ax.set_ylabel("device seconds")
    ax.set_title("Device time per hour (UTC) by kind")
    ax.legend()
    path = folder / "device_time_per_hour.png"
    fig.savefig(path, dpi=100)
    written.append(path)
    return written
