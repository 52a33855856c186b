"""What `mqinfer plan` prints: the table, the JSON, and the plot of p99 TTFT against the rate for
each worker count (`--plot FILE`, when matplotlib is installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mqinfer.loadgen.plan.model import Calibration


def calibration_dict(calibration: Calibration, path: Path) -> dict[str, Any]:
    m, q, loop = calibration.model, calibration.quality, calibration.loop
    return {"path": str(path), "measured_at": calibration.measured_at, "model_id": calibration.model_id,
            "device": calibration.device, "num_threads": calibration.num_threads,
            "step_s_fixed": m.step_s_fixed, "token_s": m.token_s, "seq_s": m.seq_s, "pair_s": m.pair_s,
            "decode_ctx_s": m.decode_ctx_s,
            "num_steps": q.num_steps, "median_abs_rel_error": q.median_abs_rel_error,
            "p90_abs_rel_error": q.p90_abs_rel_error, "startup_s": calibration.startup_s,
            "num_kv_blocks": calibration.num_kv_blocks, "calibration_s": calibration.calibration_s,
            "step_overhead_s": calibration.step_overhead_s, "gap_s": _median(calibration.gap_samples_s),
            "mean_gap_s": loop.mean_gap_s, "flush_s": _median(calibration.flush_samples_s),
            "wake_s": _median(calibration.wake_samples_s), "first_step_s": calibration.first_step_s,
            "step_noise_p90": _quantile(calibration.step_noise, 0.9), "contention": list(calibration.contention),
            "startup_source": calibration.startup_source, "machine": calibration.machine}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _median(values: list[float]) -> float | None:
    return _quantile(values, 0.5)


def ms_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000.0
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def ms_value(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def usd_text(value: float) -> str:
    if value == 0:
        return "$0"
    digits = max(2, 2 - int(math.floor(math.log10(abs(value)))) + 1)
    return f"${value:.{min(digits, 10)}f}"


def _band_text(plan: dict[str, Any]) -> str:
    band = plan.get("ttft_p99_band")
    if not band or band.get("ttft_p99_s_faster") is None or band.get("ttft_p99_s_slower") is None:
        return ""
    return (f" (p99 {ms_text(band['ttft_p99_s_faster'])} to {ms_text(band['ttft_p99_s_slower'])} if this machine "
            f"runs {100 * band['speed_change']:g}% faster or slower)")


def render(plan: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(plan, indent=2, sort_keys=False)
    if "calibrated" in plan:
        c = plan["calibration"]
        return (f"calibrated: {c['num_steps']} steps fitted (median error {100 * c['median_abs_rel_error']:.1f}%), "
                f"start-up {c['startup_s']:.2f} s; stored in {plan['calibrated']}")
    t, lay, k, c = plan["target"], plan["layout"], plan["keda"], plan["calibration"]
    threads = f", {lay['num_threads']} thread(s) per worker" if lay["num_threads"] else ""
    mean_in = plan["prompt_tokens"] / max(1, plan["num_requests"])
    mean_out = plan["output_tokens"] / max(1, plan["num_requests"])
    how = "the fewest that meet the target" if plan["workers_searched"] else "as given"
    rows = [
        ("workers", f"{plan['workers']} ({how}; each bills {lay['device_share']:.3g} of a device)"),
        ("target", f"{t['description']}: {'met' if t['met'] else 'NOT MET'} ({t['checked']})"),
        ("utilisation", f"{100 * plan['utilisation']:.1f}% of the workers' time busy (steps, the loop around them, "
                        "flushes)"),
        ("TTFT p50 / p99", f"{ms_text(plan['ttft_p50_s'])} / {ms_text(plan['ttft_p99_s'])}" + _band_text(plan)),
        ("TPOT p50 / p99", f"{ms_text(plan['tpot_p50_s'])} / {ms_text(plan['tpot_p99_s'])}"),
        ("output_tokens_per_s", f"{plan['output_tokens_per_s']:.1f} (while requests run, start-up excluded)"),
    ]
    if plan.get("interactive_ttft_p99_s") is not None:
        rows.append(("interactive p99 TTFT / TPOT", f"{ms_text(plan['interactive_ttft_p99_s'])} / "
                                                   f"{ms_text(plan.get('interactive_tpot_p99_s'))} (the requests "
                                                   "with latency targets)"))
    if plan["job_s"] is not None:
        rows.append(("job time", f"{plan['job_s']:.1f} s (start-up {plan['startup_s']:.1f} s + "
                                 f"{plan['job_s'] - plan['startup_s']:.1f} s running)"))
    rows += [
        ("cost per request", f"{usd_text(plan['cost_per_request_usd'])} at ${plan['price_per_device_hour']:g} per "
                             f"device-hour ({usd_text(plan['worker_hour_usd'])} per worker-hour)"),
        ("cost per 1M tokens", f"{usd_text(plan['cost_per_million_tokens_usd'])} (prompt + output), "
                               f"{usd_text(plan['cost_per_million_output_tokens_usd'])} per 1M output tokens"),
        ("start-up vs warm", f"start-up {100 * plan['startup_share']:.1f}% ({usd_text(plan['startup_cost_usd'])}: "
                             f"{plan['startup_s']:.2f} s per worker start), warm {100 * plan['warm_share']:.1f}% "
                             f"({usd_text(plan['warm_cost_usd'])}"
                             + (f" over the simulated {plan['window_s']:.0f} s)" if t["kind"] == "online" else ")")),
        ("KEDA", f"minReplicaCount {k['min_replicas']}, maxReplicaCount {k['max_replicas']} ({k['why']})"),
    ]
    width = max(len(name) for name, _ in rows)
    head = (f"mqinfer plan: {plan['model']} on {lay['accelerator'] or c['machine'].get('processor', lay['device'])} "
            f"({lay['device']}{threads}); workload {plan['workload']}: {plan['num_requests']} requests, "
            f"{mean_in:.0f} prompt + {mean_out:.0f} output tokens on average")
    lines = [head, ""] + [f"  {name:<{width}}  {value}" for name, value in rows]
    if len(plan["search"]) > 1:
        lines += ["", "  workers tried: " + "; ".join(
            f"{s['workers']} ({'met' if s['met'] else 'not met'}: {s['checked']})" for s in plan["search"])]
    lines += ["", f"  step-cost model: {1000 * c['step_s_fixed']:.3g} ms + {1e6 * c['token_s']:.3g} us/token + "
              f"{1e6 * c['seq_s']:.3g} us/request + {1e9 * c['pair_s']:.3g} ns/prompt attention pair + "
              f"{1e9 * c['decode_ctx_s']:.3g} ns/decode context token; fitted on {c['num_steps']} step shapes "
              f"(median error {100 * c['median_abs_rel_error']:.1f}%) at {c['measured_at']} ({c['path']})",
              f"  worker loop: {ms_text(c['mean_gap_s'])} between steps (mean), a flush of rows "
              f"{ms_text(c['flush_s'])} (median), {ms_text(c['wake_s'])} to wake on an arrival (median), "
              f"a fresh worker's first steps +{ms_text(c['first_step_s'])}"]
    if c["contention"]:
        lines.append("  workers sharing a machine: a step takes " + ", ".join(
            f"{f:.2f}x" for f in c["contention"]) + " as long beside 1, 2, ... others in a step")
    lines += [f"  note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def can_plot() -> bool:
    """Whether matplotlib can be imported (``plot_sweep`` draws with it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_sweep(plan: dict[str, Any], path: str) -> str | None:
    """Draw ``plan["sweep"]`` (p99 TTFT against requests per second, a line per worker count, the
    SLO and the planned rate marked) into ``path`` (its suffix picks the format: .png, .svg,
    .pdf); a note instead when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot written to {path}: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for workers in sorted({p["workers"] for p in plan["sweep"]}):
            points = sorted((p["rate"], p["ttft_p99_s"]) for p in plan["sweep"] if p["workers"] == workers
                            and p["ttft_p99_s"] is not None)
            ax.plot([r for r, _ in points], [1000 * t for _, t in points], marker="o",
                    label=f"{workers} worker{'s' if workers > 1 else ''}")
        target = plan["target"]
        if target.get("slo_ttft_p99_ms"):
            ax.axhline(target["slo_ttft_p99_ms"], color="grey", linestyle="--", label="SLO")
        if target.get("rate"):
            ax.axvline(target["rate"], color="grey", linestyle=":", label="planned rate")
        values = [p["ttft_p99_s"] for p in plan["sweep"] if p["ttft_p99_s"]]
        if values and max(values) > 20 * min(values):  # an overloaded count's queue next to the others
            ax.set_yscale("log")
        ax.set_xlabel("requests per second")
        ax.set_ylabel("p99 TTFT (ms)")
        ax.set_title(f"mqinfer plan: {plan['model']}, workload {plan['workload']}")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, bbox_inches="tight")
    finally:
        plt.close(fig)
    return None
