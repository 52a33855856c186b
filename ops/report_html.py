"""A cost report as one self-contained HTML page (``mqinfer report costs --html FILE``).

The page holds the report's tables and five charts drawn as inline SVG: the billed cost of the
groups per hour, dollars per million tokens by group, the distribution of cost per request, the
share of device time by kind (the overhead share), and the budgets against their spend. It loads
nothing: no script, no style sheet, no font, no image from anywhere else, so it opens offline and
can be mailed or archived as one file.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from mqinfer.ops.report import Report
from mqinfer.ops.report_render import (budget_mark, budget_status, fmt_number, summary_by_name, summary_lines,
                                        table_fields)
from mqinfer.schemas.rows import COST_KINDS

# The charts, by the id of the figure that holds each (tests look them up by these).
CHARTS = ("cost-over-time", "usd-per-million-tokens", "cost-per-request", "overhead-share", "budgets")
# Groups drawn one by one in the cost-over-time chart; the rest are summed as "other".
MAX_SERIES = 8
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
KIND_COLORS = {"request": "#4e79a7", "idle": "#bab0ac", "startup": "#f28e2b", "duplicate": "#e15759",
               "lost": "#b07aa1"}
WIDTH = 760

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4}
td.k,th.k{text-align:left;white-space:nowrap}tr.sum td{font-weight:600}.wide{overflow-x:auto}
figure{margin:12px 0}figcaption{color:#555}
svg text{font:11px system-ui,sans-serif;fill:#333}.over{color:#b00;font-weight:600}
"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _label(key: dict) -> str:
    return " / ".join("(none)" if v is None else str(v) for v in key.values()) or "(all)"


def _money(value: float) -> str:
    return f"${value:.4g}"


def _svg(height: int, body: list[str], title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_e(title)}">' + "".join(body) + "</svg>")


def _figure(chart: str, title: str, svg: str, caption: str) -> str:
    return f'<figure id="{chart}"><h2>{_e(title)}</h2>{svg}<figcaption>{_e(caption)}</figcaption></figure>'


def _hbars(rows: Sequence[tuple[str, float, str]], title: str, fmt=_money) -> str:
    """Horizontal bars: (label, value, color) each, longest first as given."""
    left, right, bar_h = 220, 110, 18
    height = 20 + bar_h * max(len(rows), 1) + 10
    top = max((v for _, v, _ in rows), default=0.0) or 1.0
    body = []
    for i, (label, value, color) in enumerate(rows):
        y = 10 + i * bar_h
        w = (WIDTH - left - right) * max(value, 0.0) / top
        body.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_e(label[:34])}</text>'
                    f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" fill="{color}">'
                    f'<title>{_e(label)}: {_e(fmt(value))}</title></rect>'
                    f'<text x="{left + w + 4:.1f}" y="{y + 13}">{_e(fmt(value))}</text>')
    if not rows:
        body.append('<text x="10" y="20">(nothing to draw)</text>')
    return _svg(height, body, title)


def _cost_over_time(report: Report) -> str:
    totals: dict[str, float] = {}
    for p in report.hourly_by_group:
        totals[_label(p.key)] = totals.get(_label(p.key), 0.0) + p.cost_usd
    named = sorted(totals, key=lambda k: -totals[k])[:MAX_SERIES]
    series = named + (["other"] if len(totals) > len(named) else [])
    hours = sorted({p.hour for p in report.hourly_by_group})
    stack = {h: dict.fromkeys(series, 0.0) for h in hours}
    for p in report.hourly_by_group:
        label = _label(p.key)
        stack[p.hour][label if label in named else "other"] += p.cost_usd
    left, bottom, top_pad, legend_w = 80, 40, 10, 170
    height = 260
    plot_w, plot_h = WIDTH - left - legend_w, height - bottom - top_pad
    peak = max((sum(v.values()) for v in stack.values()), default=0.0) or 1.0
    slot = plot_w / max(len(hours), 1)
    body = [f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{left + plot_w}" y2="{top_pad + plot_h}" stroke="#999"/>',
            f'<text x="{left - 6}" y="{top_pad + 10}" text-anchor="end">{_e(_money(peak))}</text>',
            f'<text x="{left - 6}" y="{top_pad + plot_h}" text-anchor="end">$0</text>']
    for i, hour in enumerate(hours):
        x, y = left + i * slot + slot * 0.15, top_pad + plot_h
        for j, name in enumerate(series):
            h = plot_h * stack[hour][name] / peak
            y -= h
            body.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" '
                        f'fill="{PALETTE[j % len(PALETTE)]}"><title>{_e(hour)} {_e(name)}: '
                        f'{_e(_money(stack[hour][name]))}</title></rect>')
        if len(hours) <= 24 or i % max(len(hours) // 12, 1) == 0:
            body.append(f'<text x="{left + (i + 0.5) * slot:.1f}" y="{top_pad + plot_h + 14}" '
                        f'text-anchor="middle">{_e(hour[5:13].replace("T", " "))}h</text>')
    for j, name in enumerate(series):
        y = top_pad + 14 * j
        body.append(f'<rect x="{WIDTH - legend_w + 10}" y="{y}" width="10" height="10" '
                    f'fill="{PALETTE[j % len(PALETTE)]}"/><text x="{WIDTH - legend_w + 24}" y="{y + 9}">'
                    f'{_e(name[:24])}</text>')
    if not hours:
        body.append('<text x="10" y="20">(no billed requests)</text>')
    return _svg(height, body, "Billed cost per hour by group")


def _cost_per_request(report: Report) -> str:
    bins = report.cost_distribution
    left, bottom, top_pad = 90, 80, 10
    height = 260
    plot_w, plot_h = WIDTH - left - 20, height - bottom - top_pad
    peak = max((b.requests for b in bins), default=0) or 1
    slot = plot_w / max(len(bins), 1)
    body = [f'<text x="{left - 6}" y="{top_pad + 10}" text-anchor="end">{peak} requests</text>',
            f'<text x="{left - 6}" y="{top_pad + plot_h}" text-anchor="end">0</text>']
    for i, b in enumerate(bins):
        h = plot_h * b.requests / peak
        x = left + i * slot
        label = "$0" if b.hi_usd == 0 else f"${b.lo_usd:.2g}-{b.hi_usd:.2g}"
        body.append(f'<rect x="{x + 1:.1f}" y="{top_pad + plot_h - h:.1f}" width="{max(slot - 2, 1):.1f}" '
                    f'height="{h:.1f}" fill="#4e79a7"><title>{_e(label)} USD: {b.requests} requests</title></rect>'
                    f'<text x="{x + slot / 2:.1f}" y="{top_pad + plot_h + 14}" text-anchor="end" '
                    f'transform="rotate(-35 {x + slot / 2:.1f} {top_pad + plot_h + 14})">{_e(label)}</text>')
    if not bins:
        body.append('<text x="10" y="20">(no billed requests)</text>')
    return _svg(height, body, "Requests by cost (USD, log-spaced bins)")


def _overhead_share(report: Report) -> str:
    t = report.totals
    body, x, left = [], 10.0, 10.0
    width = WIDTH - 20
    for kind in COST_KINDS:
        share = t.device_share_by_kind[kind]
        w = width * share
        body.append(f'<rect x="{x:.1f}" y="10" width="{w:.1f}" height="28" fill="{KIND_COLORS[kind]}">'
                    f'<title>{kind}: {100 * share:.2f}% ({t.device_s_by_kind[kind]:.3f} s)</title></rect>')
        x += w
    for i, kind in enumerate(COST_KINDS):
        lx = left + i * (width / len(COST_KINDS))
        body.append(f'<rect x="{lx:.1f}" y="48" width="10" height="10" fill="{KIND_COLORS[kind]}"/>'
                    f'<text x="{lx + 14:.1f}" y="57">{kind} {100 * t.device_share_by_kind[kind]:.1f}%</text>')
    return _svg(70, body, "Device time by kind")


def _budgets(report: Report) -> str:
    statuses = report.budgets or []
    left, right, bar_h = 240, 120, 20
    height = 20 + bar_h * max(len(statuses), 1)
    scale = max([1.0] + [s.spent_usd / s.budget_usd for s in statuses if s.budget_usd > 0])
    plot_w = WIDTH - left - right
    body = []
    thresholds = sorted({t for s in statuses for t in s.thresholds_reached})
    for i, s in enumerate(statuses):
        y = 10 + i * bar_h
        share = s.spent_usd / s.budget_usd if s.budget_usd > 0 else (scale if s.spent_usd > 0 else 0.0)
        color = "#e15759" if s.over else "#edc948" if s.thresholds_reached else "#59a14f"
        body.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{_e(s.group[:36])}</text>'
                    f'<rect x="{left}" y="{y + 3}" width="{plot_w / scale:.1f}" height="{bar_h - 6}" fill="#eee"/>'
                    f'<rect x="{left}" y="{y + 3}" width="{plot_w * share / scale:.1f}" height="{bar_h - 6}" '
                    f'fill="{color}"><title>{_e(s.group)}: {_e(_money(s.spent_usd))} of '
                    f'{_e(_money(s.budget_usd))}</title></rect>'
                    f'<text x="{left + plot_w + 6}" y="{y + 14}">{100 * share:.0f}% of {_e(_money(s.budget_usd))}'
                    f'</text>')
    for t in thresholds:
        x = left + plot_w * (t / 100.0) / scale
        body.append(f'<line x1="{x:.1f}" y1="6" x2="{x:.1f}" y2="{height - 4}" stroke="#999" '
                    f'stroke-dasharray="3,3"><title>{t:g}%</title></line>')
    if not statuses:
        body.append('<text x="10" y="20">(no budgets: give --budgets FILE)</text>')
    return _svg(height, body, "Budgets against spend")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], keys: int = 1,
           sums: Sequence[Sequence[str]] = ()) -> str:
    def cells(values, tag):
        return "".join(f'<{tag} class="k">{_e(v)}</{tag}>' if i < keys else f"<{tag}>{_e(v)}</{tag}>"
                       for i, v in enumerate(values))
    out = ['<div class="wide"><table><thead><tr>' + cells(headers, "th") + "</tr></thead><tbody>"]
    out += ["<tr>" + cells(r, "td") + "</tr>" for r in rows]
    out += ['<tr class="sum">' + cells(r, "td") + "</tr>" for r in sums]
    return "".join(out) + "</tbody></table></div>"


def render_html(report: Report, title: str = "mqinfer cost report") -> str:
    """The report as one HTML page (tables and inline SVG charts; nothing loaded from elsewhere)."""
    t = report.totals
    window = f"{report.since or 'the beginning'} to {report.until or 'now'}"
    fields = table_fields(report)
    group_rows = [[_label({k: g.key[k]}) for k in report.by] + [fmt_number(m, getattr(g, m)) for m in fields]
                  + ([budget_mark(g.over_budget, g.budget_threshold)] if report.budget_marks else [])
                  for g in report.groups]
    summary = summary_by_name(t)
    sums = [[label] + [""] * (len(report.by) - 1)
            + [fmt_number(m, getattr(summary[name], m)) if hasattr(summary[name], m) else "" for m in fields]
            + ([""] if report.budget_marks else []) for name, label in summary_lines(report)]
    per_million = [(_label(g.key), g.usd_per_1m_tokens, PALETTE[i % len(PALETTE)])
                   for i, g in enumerate(report.groups[:20]) if g.usd_per_1m_tokens is not None]
    per_million.sort(key=lambda r: -r[1])
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{_e(title)}</title>",
        f"<style>{_STYLE}</style></head><body>", f"<h1>{_e(title)}</h1>",
        f"<p>By {_e(', '.join(report.by))}; rows finished from {_e(window)}; basis {_e(report.basis)}. "
        f"Total {_e(_money(t.cost_usd))}: billed {_e(_money(t.billed.cost_usd))}, overhead "
        f"{_e(_money(t.overhead.cost_usd))}, duplicate {_e(_money(t.duplicate.cost_usd))}.</p>",
        '<h2 id="groups">Groups</h2>',
        _table(list(report.by) + list(fields) + (["budget"] if report.budget_marks else []), group_rows,
               keys=len(report.by), sums=sums),
        _figure("cost-over-time", "Cost by group over time", _cost_over_time(report),
                f"Billed cost per UTC hour, stacked by {', '.join(report.by)} (the {MAX_SERIES} costliest groups; "
                "the rest as other)."),
        _figure("usd-per-million-tokens", "Dollars per million tokens by group",
                _hbars(per_million, "USD per million tokens by group", fmt=lambda v: f"${v:.4f}"),
                "Billed cost over prompt + output tokens, of the 20 costliest groups."),
        _figure("cost-per-request", "Cost per request", _cost_per_request(report),
                "How many requests cost how much (every choice of a request together)."),
        _figure("overhead-share", "Overhead share", _overhead_share(report),
                "Share of all device time by kind: requests, and the overhead no request paid for."),
        _figure("budgets", "Budgets against spend", _budgets(report),
                "Each budgeted group's spend over its budget (dashed: warning thresholds reached)."),
    ]
    if report.top_requests:
        parts += ["<h2>Most expensive requests</h2>", _table(
            ["job_id", "id", "tenant", "worker", "prompt_tokens", "output_tokens", "device_s", "cost_usd"],
            [[r.job_id or "(none)", r.id or "", r.tenant or "", r.worker, r.prompt_tokens, r.output_tokens,
              fmt_number("device_s", r.device_s), fmt_number("cost_usd", r.cost_usd)] for r in report.top_requests],
            keys=4)]
    if report.hourly:
        parts += ["<h2>Per hour (UTC)</h2>", _table(
            ["hour", "requests", *(f"{k}_s" for k in COST_KINDS), "cost_usd"],
            [[h.hour, h.requests, *(fmt_number("device_s", h.device_s_by_kind[k]) for k in COST_KINDS),
              fmt_number("cost_usd", h.cost_usd)] for h in report.hourly])]
    if report.budgets:
        parts += ["<h2>Budgets</h2>", _table(
            ["group", "period", "budget_usd", "spent_usd", "remaining_usd", "status"],
            [[s.group, s.period or "total", fmt_number("usd", s.budget_usd), fmt_number("usd", s.spent_usd),
              fmt_number("usd", s.remaining_usd), budget_status(s)] for s in report.budgets])]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


__all__ = ["CHARTS", "render_html"]
