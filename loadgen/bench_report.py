"""The report of `mqinfer bench`: the text on stdout, the JSON file and the charts.

Owns the systems table, the online budget lines and wait table, the llama.cpp table, the run's
command line and machine as recorded, the JSON writer (written whole, then renamed) and the PNG
charts (``--plot``, matplotlib). ``print_report`` renders a finished run from its report dict and
its table rows, so what is printed and what is saved are the same figures.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_online import OnlinePoint, wait_budget_s, wait_label
from mqinfer.loadgen.metrics import Percentiles, RunSummary


def _fmt_pct(p: Percentiles | None, scale: float = 1.0, digits: int = 3) -> str:
    if p is None:
        return "-"
    return "/".join(f"{v * scale:.{digits}g}" for v in (p.p50, p.p90, p.p99))


def format_table(rows: list[tuple[str, RunSummary]]) -> str:
    w = max([22] + [len(name) for name, _ in rows])
    head = (f"{'system':<{w}} {'tok/s':>9} {'span s':>8} {'reqs':>5} {'err':>4}  "
            f"{'TTFT s p50/p90/p99':<22} {'TPOT ms p50/p90/p99':<22} {'e2e s p50/p90/p99':<22}")
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(f"{name:<{w}} {s.throughput:>9.1f} {s.span_s:>8.2f} {s.num_requests:>5d} {s.num_errors:>4d}  "
                     f"{_fmt_pct(s.ttft):<22} {_fmt_pct(s.tpot, 1000.0):<22} {_fmt_pct(s.e2e):<22}")
    return "\n".join(lines)


def point_name(point: OnlinePoint, with_wait: bool) -> str:
    name = f"mqinfer @{point.rate:g} req/s"
    return f"{name} wait {wait_label(point.max_wait_ms)}" if with_wait else name


def budget_line(point: OnlinePoint) -> str:
    """'p99 TTFT X ms vs budget Y ms (max_wait W + 3 x step S): met|not met', in milliseconds."""
    b = point.budget
    if b is None:
        return "no p99 TTFT or engine step measured (no request with two or more tokens)"
    wait_text = wait_budget_s(point.max_wait_ms)[1] if point.max_wait_ms is not None else f"{b.max_wait_s * 1000:g}"
    return (f"p99 TTFT {b.ttft_p99_s * 1000:.1f} ms vs budget {b.budget_s * 1000:.1f} ms (max_wait {wait_text} + "
            f"{b.steps} x step {b.step_s * 1000:.1f}, step = TPOT p50): {'met' if b.met else 'not met'}")


def format_wait_table(points: list[OnlinePoint]) -> str:
    """One row per offered rate and wait setting, rates ascending."""
    head = (f"{'req/s':>7} {'wait':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tok/s':>9} "
            f"{'budget ms':>10} {'goal':>8}")
    lines = [head, "-" * len(head)]
    for p in sorted(points, key=lambda q: q.rate):  # stable: settings keep their order within a rate
        ttft = p.summary.ttft
        p50, p99 = (f"{ttft.p50 * 1000:.1f}", f"{ttft.p99 * 1000:.1f}") if ttft else ("-", "-")
        budget = f"{p.budget.budget_s * 1000:.1f}" if p.budget else "-"
        goal = ("met" if p.budget.met else "not met") if p.budget else "-"
        lines.append(f"{p.rate:>7g} {wait_label(p.max_wait_ms):>8} {p50:>12} {p99:>12} {p.summary.throughput:>9.1f} "
                     f"{budget:>10} {goal:>8}")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def check_plotting(plot_dir: str | None) -> str | None:
    if plot_dir is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(or run without --plot)")
    return None


def _save(fig, path: Path) -> Path:
    """Lay out, write and close one chart."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(plot_dir: Path, systems: list[tuple[str, float]], online: list[OnlinePoint]) -> list[Path]:
    """throughput.png (one bar per system) and, for online sweeps, latency.png (against offered load)
    or, when the points ran with several batcher waits, ttft-by-wait.png (p99 TTFT and throughput
    against offered load, one line per wait)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if systems:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [n for n, _ in systems]
        values = [v for _, v in systems]
        bars = ax.bar(names, values, color=["tab:blue" if n.startswith("mqinfer") else "tab:gray" for n in names])
        ax.bar_label(bars, fmt="%.0f")
        ax.margins(y=0.12)  # room for the labels above the tallest bar
        ax.set_ylabel("requested output tokens / s")
        ax.set_title("Throughput by system")
        ax.tick_params(axis="x", labelrotation=20)
        written.append(_save(fig, plot_dir / "throughput.png"))
    by_wait: dict[str, list[OnlinePoint]] = {}
    for p in online:
        by_wait.setdefault(wait_label(p.max_wait_ms), []).append(p)
    if len(by_wait) > 1:
        fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
        for label, points in by_wait.items():
            points = sorted(points, key=lambda q: q.rate)
            rates = [p.rate for p in points]
            ax_ttft.plot(rates, [p.summary.ttft.p99 * 1000 if p.summary.ttft else float("nan") for p in points],
                         marker="o", label=f"wait {label}")
            ax_tput.plot(rates, [p.summary.throughput for p in points], marker="o", label=f"wait {label}")
        for ax, title in ((ax_ttft, "p99 time to first token (ms)"), (ax_tput, "requested output tokens / s")):
            ax.set_xlabel("offered load (requests / s)")
            ax.set_title(title)
            ax.legend()
        written.append(_save(fig, plot_dir / "ttft-by-wait.png"))
    elif online:
        online = sorted(online, key=lambda q: q.rate)
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        rates = [p.rate for p in online]
        for ax, metric, title, scale in ((axes[0], "ttft", "time to first token (s)", 1.0),
                                         (axes[1], "tpot", "time per output token (ms)", 1000.0),
                                         (axes[2], "e2e", "end-to-end latency (s)", 1.0)):
            for q in ("p50", "p90", "p99"):
                ys = [getattr(getattr(p.summary, metric), q) * scale if getattr(p.summary, metric) else float("nan")
                      for p in online]
                ax.plot(rates, ys, marker="o", label=q)
            ax.set_xlabel("offered load (requests / s)")
            ax.set_title(title)
            ax.legend()
        written.append(_save(fig, plot_dir / "latency.png"))
    return written


def budget_dict(point: OnlinePoint) -> dict[str, Any] | None:
    if point.budget is None:
        return None
    wait_source = wait_budget_s(point.max_wait_ms)[1] if point.max_wait_ms is not None else None
    return {**asdict(point.budget), "max_wait_source": wait_source, "step_source": "tpot_p50"}


def command_line() -> str:
    prog = Path(sys.argv[0]).name
    if prog in ("bench.py", "__main__.py"):
        prog = "python -m mqinfer.loadgen.bench"  # what `python -m` leaves in argv[0] is a path
    return " ".join([prog, *sys.argv[1:]])


def save_json(path: str | None, report: dict[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, target)  # a reader never sees half a file


def machine_info() -> dict[str, Any]:
    """What the figures depend on: processor, cores, matrix extensions, and other load right now."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu" not in info:
            info["cpu"] = value.strip()
        elif key.strip() == "flags" and "flags" not in info:
            flags = value.split()
            info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
    return info


def format_llamacpp_table(llamacpp: dict[str, Any]) -> str:
    """mqinfer's and each llama.cpp thread count's times and tokens per second, S = (prompt +
    generated tokens) / total time as llama-batched-bench counts it."""
    head = (f"{'system':<22} {'T_PP s':>8} {'S_PP t/s':>9} {'T_TG s':>8} {'S_TG t/s':>9} {'T s':>8} "
            f"{'S t/s':>9}")
    lines = [head, "-" * len(head)]
    ours = llamacpp.get("mqinfer")
    if ours is not None:
        lines.append(f"{'mqinfer offline':<22} {'-':>8} {'-':>9} {'-':>8} {'-':>9} {ours['span_s']:>8.3f} "
                     f"{ours['tok_s']:>9.2f}")
    for run in llamacpp["runs"]:
        lines.append(f"{'llama.cpp -t ' + str(run['threads']):<22} {run['t_pp_s']:>8.3f} {run['s_pp_tok_s']:>9.2f} "
                     f"{run['t_tg_s']:>8.3f} {run['s_tg_tok_s']:>9.2f} {run['t_s']:>8.3f} {run['s_tok_s']:>9.2f}")
    return "\n".join(lines)


def print_report(report: dict[str, Any], table_rows: list[tuple[str, RunSummary]], online: list[OnlinePoint]) -> None:
    """The finished run on stdout: every line from ``report`` (the JSON's figures) and the rows."""
    _print_header(report)
    print(format_table(table_rows))
    _print_engine_notes(report)
    with_wait = bool(report.get("compare_wait"))
    for p in online:
        print(f"{point_name(p, with_wait)}: {budget_line(p)}")
    if with_wait:
        print(format_wait_table(online))
    throughputs = dict((name, s.throughput) for name, s in table_rows)
    _print_hf_comparison(report, throughputs)
    _print_variant_comparisons(report, throughputs)
    _print_prefix_cache(report, throughputs)
    if "llamacpp" in report:
        _print_llamacpp(report["llamacpp"])
    _print_ceiling(report)


def _print_header(report: dict[str, Any]) -> None:
    """The workload, model and mode, then the machine."""
    w, flags = report["workload"], report["engine_flags"]
    print(f"mqinfer bench: workload {w['name']} ({w['num_requests']} requests, {w['prompt_tokens']} prompt "
          f"tokens, {w['output_tokens']} output tokens asked for, seed {w['seed']}), model {report['model']['arg']}, "
          f"dtype {flags['dtype']}, mode {report['mode']}")
    machine = report["machine"]
    print(f"machine: {machine.get('cpu', '?')}, {machine['cpus']} cpus, "
          f"{' '.join(f for f in machine.get('flags', []) if f.startswith(('amx', 'avx512_bf16'))) or 'no bf16 units'}"
          f"; load average at start {machine['load_average'][0]:.2f}")


def _print_engine_notes(report: dict[str, Any]) -> None:
    """What our own run adds under the table: its overhead, its speculation, the rate `--rate half` chose."""
    if "overhead" in report:
        o = report["overhead"]
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in o["phases_s"].items())
        print(f"overhead: {o['outside_forward_share']:.1%} of the workers' busy time ({o['busy_s']:.2f}s) is outside "
              f"the forward pass ({parts})")
    if "speculation" in report:
        s = report["speculation"]
        if s["num_checks"]:
            print(f"speculation ({s['proposer']}): {s['proposed_tokens']} proposed tokens checked in {s['num_checks']} "
                  f"request-steps of {s['steps']} engine steps; acceptance {s['acceptance']:.2f}, "
                  f"{s['tokens_per_check']:.2f} tokens per checking step")
        else:
            print(f"speculation ({s['proposer']}): nothing proposed in {s['steps']} engine steps")
    if "rate_half" in report:
        half = report["rate_half"]
        print(f"--rate half: offline throughput {half['offline_req_s']:.3g} req/s, so online at {half['rate']:g} req/s")


def _print_hf_comparison(report: dict[str, Any], throughputs: dict[str, float]) -> None:
    """Our offline throughput over transformers' (static and continuous), and their greedy agreement."""
    ours = throughputs.get("mqinfer offline")
    static_best = report.get("hf_static_best")
    if ours is not None and static_best in throughputs:
        print(f"mqinfer / transformers static batching (best: {static_best}): "
              f"{_ratio(ours, throughputs[static_best])}")
    if ours is not None and "hf-continuous" in throughputs:
        print(f"mqinfer / transformers continuous batching: {_ratio(ours, throughputs['hf-continuous'])}")
    if "agreement_vs_hf_static" in report:
        a = report["agreement_vs_hf_static"]
        print(f"greedy agreement with {static_best} over {a['compared']} requests: first token "
              f"{a['first_token']:.0%}, identical output {a['identical']:.0%}, common prefix "
              f"{a['common_prefix']:.0%} on average (bf16 near-ties make later tokens differ)")


def _print_variant_comparisons(report: dict[str, Any], throughputs: dict[str, float]) -> None:
    """Our offline throughput over each rerun with one thing changed, their agreement, and the rounds."""
    ours = throughputs.get("mqinfer offline")
    flags = report["engine_flags"]
    if ours is not None and "mqinfer offline, unquantized" in throughputs:
        print(f"mqinfer --quantization {flags['quantization']} --kv-cache-dtype {flags['kv_cache_dtype']} / unquantized: "
              f"{_ratio(ours, throughputs['mqinfer offline, unquantized'])}")
    if "agreement_vs_unquantized" in report:
        a = report["agreement_vs_unquantized"]
        print(f"greedy agreement with the unquantized run over {a['compared']} requests: first token "
              f"{a['first_token']:.0%}, identical output {a['identical']:.0%}, common prefix "
              f"{a['common_prefix']:.0%} on average")
    if ours is not None and "mqinfer offline, other layout" in throughputs:
        other = report["systems"]["mqinfer offline, other layout"]
        print(f"mqinfer ({report['workers']} worker(s) x {flags['num_threads'] or 1} thread(s)) / the other layout "
              f"({other['workers']} x {other['num_threads']}): "
              f"{_ratio(ours, throughputs['mqinfer offline, other layout'])}")
    if ours is not None and "mqinfer offline, unspeculative" in throughputs:
        print(f"mqinfer --speculative {flags['speculative']} / unspeculative: "
              f"{_ratio(ours, throughputs['mqinfer offline, unspeculative'])}")
    if "agreement_vs_unspeculative" in report:
        a = report["agreement_vs_unspeculative"]
        print(f"greedy agreement with the unspeculative run over {a['compared']} requests: identical output "
              f"{a['identical']:.0%} (bf16 batches of different shapes can break near-ties)")
    if ours is not None and "mqinfer offline, global scope" in throughputs:
        print(f"mqinfer --prefix-cache-scope {flags.get('prefix_cache_scope')} / global: "
              f"{_ratio(ours, throughputs['mqinfer offline, global scope'])}")
    if "agreement_vs_global_scope" in report:
        a = report["agreement_vs_global_scope"]
        print(f"greedy agreement with the global-scope run over {a['compared']} requests: identical output "
              f"{a['identical']:.0%}")
    for variant, r in report.get("rounds", {}).items():
        print(f"mqinfer / {variant} over {len(r['ratios'])} rounds (alternating which ran first): "
              + ", ".join(f"{x:.2f}x" for x in r["ratios"]) + f"; median {r['median_ratio']:.2f}x")


def _print_prefix_cache(report: dict[str, Any], throughputs: dict[str, float]) -> None:
    """The prefix cache's hits (and the work per shard), then the same for the input-order rerun."""
    from mqinfer.loadgen.prefix_cache import describe

    ours = throughputs.get("mqinfer offline")
    if "prefix_cache" in report:
        shards = report.get("shards", 1)
        print(f"mqinfer (--order {report.get('order')}"
              + (f", {shards} shards routed by {report.get('route')}" if shards > 1 else "") + "): "
              + describe(report["prefix_cache"]))
        routing = report.get("routing")
        if routing and routing.get("routed"):
            total = sum(routing["load"]) or 1
            print("  work per shard " + " ".join(f"{100.0 * x / total:.0f}%" for x in routing["load"])
                  + f", {routing['spilled']} of {routing['routed']} requests spilled over from their prefix's shard")
    unordered = report.get("systems", {}).get("mqinfer offline, input order")
    if ours is not None and unordered and "mqinfer offline, input order" in throughputs:
        print(f"mqinfer / the same with --order input --route id: "
              f"{_ratio(ours, throughputs['mqinfer offline, input order'])}")
        if unordered.get("prefix_cache"):
            print("  input order: " + describe(unordered["prefix_cache"]))
    scoped = report.get("systems", {}).get("mqinfer offline, global scope")
    if scoped and scoped.get("prefix_cache"):
        print("  --prefix-cache-scope global: " + describe(scoped["prefix_cache"]))


def _print_llamacpp(lc: dict[str, Any]) -> None:
    """What llama-batched-bench ran, its table, and our throughput over its best thread count's."""
    print(f"llama.cpp: llama-batched-bench -npp {lc['prompt_len']} -ntg {lc['output_len']} -npl "
          f"{lc['num_requests']} on {Path(lc['gguf']).name}; S = (prompt + generated tokens) / total time, "
          f"for mqinfer over its span (first started -> last finished)")
    print(format_llamacpp_table(lc))
    if lc.get("mqinfer") is not None:
        best = next(r for r in lc["runs"] if r["threads"] == lc["best_threads"])
        print(f"mqinfer / llama.cpp (best: -t {lc['best_threads']}): {_ratio(lc['mqinfer']['tok_s'], best['s_tok_s'])}")


def _print_ceiling(report: dict[str, Any]) -> None:
    """The matrix rate, the workload's matrix work, the compute ceiling, each system's share, the roofs."""
    rate, before, after, flops = (report["matrix_rate"], report["matrix_rate_before"], report["matrix_rate_after"],
                                  report["flops"])
    print(f"{rate['dtype']} matrix rate: {rate['flops_per_s'] / 1e12:.3f} TFLOP/s ({rate['size']}^3 matmul on "
          f"{rate['device']}, {rate['threads']} threads, best of 5 before and 5 after the runs: "
          f"{before['flops_per_s'] / 1e12:.3f} and {after['flops_per_s'] / 1e12:.3f}); workload: "
          f"{flops['total'] / 1e12:.3f} TFLOP of matmuls ({flops['params_convention'] / 1e12:.3f} counting the "
          f"embedding table as 2 x params does); compute ceiling {report['compute_ceiling_tok_s']:.0f} tok/s")
    shares = report.get("ceiling_share") or {}
    if shares:
        print("share of the ceiling: " + ", ".join(f"{n} {v:.1%}" for n, v in shares.items()))
    if "roofs" in report:
        print(format_roofs(report["roofs"], rate["dtype"]))


def format_roofs(roofs: dict[str, Any], dtype: str) -> str:
    """The two roofs as least times for the workload, then each system's share of each."""
    b, bw = roofs["bytes"], roofs["bandwidth"]
    lines = [f"roofs: compute {roofs['compute_s']:.3f} s (the {dtype} matrix rate); memory {roofs['memory_s']:.3f} s "
             f"({b['total'] / 1e9:.2f} GB: {b['steps']} steps x {b['weight_bytes'] / 1e6:.1f} MB of weights + "
             f"{b['kv_bytes'] / 1e9:.3f} GB of KV cache, at a copy bandwidth of {bw['bytes_per_s'] / 1e9:.1f} GB/s, "
             f"{bw['threads']} threads, {bw['array_bytes'] >> 20} MiB arrays)"]
    for name, share in roofs["shares"].items():
        lines.append(f"  {name}: {share['compute']:.1%} of the compute roof, {share['memory']:.1%} of the memory roof")
    return "\n".join(lines)
