"""The KV memory report (``python -m mqinfer.loadgen.memory``) as a Markdown table."""

from __future__ import annotations

from typing import Any

# The goal: at least this many times the concurrent sequences of the max-length allocator.
GOAL_CONCURRENCY_RATIO = 4.0


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2%}"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def format_markdown(report: dict[str, Any], kv_bytes_per_token: int | None = None) -> str:
    return "\n".join([*_header_lines(report, kv_bytes_per_token), *_paged_table(report),
                      *_contiguous_table(report), *_engine_lines(report), *_kv_dtype_lines(report),
                      "", *_goal_lines(report)])


def _header_lines(report: dict[str, Any], kv_bytes_per_token: int | None) -> list[str]:
    """The budget, the workload and the limits the runs had, and the saturation rule."""
    w = report["workload"]
    budget = report["kv_budget_tokens"]
    mem = f" ({budget * kv_bytes_per_token / 2**20:.1f} MiB of KV for the standard checkpoint)" \
        if kv_bytes_per_token else ""
    return [
        f"KV budget {budget:,} token slots{mem}; workload {w['num_requests']} requests, "
        f"{w['prompt_tokens']:,} prompt + {w['output_tokens']:,} output tokens "
        f"({w['prompt_tokens'] + w['output_tokens']:,} slots to hold them all at once); "
        f"max_model_len {report['max_model_len']}; max_num_seqs {report['max_num_seqs']}, "
        f"max_num_batched_tokens {report['max_num_batched_tokens']}; prefix caching "
        f"{'on' if report['prefix_caching'] else 'off'}.",
        f"Saturated step: {report['saturation_rule']}. Means are over saturated steps.",
    ]


def _paged_table(report: dict[str, Any]) -> list[str]:
    """One row per block size of the paged runs."""
    lines = [
        "",
        "| block size | steps (saturated) | KV waste | unavoidable (last partial block) | estimate (bs-1)/2 per seq "
        "| KV in use | concurrent seqs mean / max | vs max-len contiguous | vs exact contiguous (first fit) "
        "| vs exact (sum bound) | preemptions |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in report["paged"]:
        lines.append(
            f"| {p['block_size']} | {p['steps']} ({p['saturated_steps']}) | {_pct(p['kv_waste'])} "
            f"| {_pct(p['unavoidable_waste'])} | {_pct(p['estimate_waste'])} | {_pct(p['kv_usage'])} "
            f"| {_num(p['concurrent_mean'])} / {_num(p['concurrent_max'], 'd')} | {_times(p['ratio_vs_max_len'])} "
            f"| {_times(p['ratio_vs_exact'])} | {_times(p['ratio_vs_exact_sum'])} | {p['preemptions']} |"
        )
    return lines


def _contiguous_table(report: dict[str, Any]) -> list[str]:
    """One row per contiguous allocator."""
    lines = [
        "",
        "| contiguous allocator | reserves per request | placement | steps (saturated) | concurrent seqs mean / max "
        "| reserved slots holding no token |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    labels = {"max_len": f"max length ({report['max_model_len']})", "exact": "exact", "exact_sum": "exact"}
    for name, c in report["contiguous"].items():
        placement = "first fit" if c["fit"] == "first-fit" else "sum of reservations <= budget"
        if c["never_fits"]:
            lines.append(f"| {labels[name]} | {c['reserves']} | {placement} | - | 0 (one reservation exceeds "
                         "the budget) | - |")
            continue
        lines.append(
            f"| {labels[name]} | {c['reserves']} | {placement} | {c['steps']} ({c['saturated_steps']}) "
            f"| {_num(c['concurrent_mean'])} / {_num(c['concurrent_max'], 'd')} | {_pct(c['kv_waste'])} |"
        )
    return lines


def _engine_lines(report: dict[str, Any]) -> list[str]:
    """The engine's cross-check per block size, when ``--engine`` ran it."""
    engine_rows = [p for p in report["paged"] if "engine" in p]
    if not engine_rows:
        return []
    lines = [""]
    for p in engine_rows:
        e = p["engine"]
        lines.append(
            f"Engine cross-check, block size {p['block_size']} ({e['model']}): {e['steps']} steps "
            f"({e['saturated_steps']} saturated), KV waste {_pct(e['kv_waste'])}, concurrent mean "
            f"{_num(e['concurrent_mean'])}; every step identical to the simulation: "
            f"{'yes' if e['identical_to_simulation'] else 'NO'}."
        )
    return lines


def _kv_dtype_lines(report: dict[str, Any]) -> list[str]:
    """The KV cache dtypes in the same memory, when ``--kv-cache-dtypes`` compared them."""
    kv = report.get("kv_cache_dtypes")
    if not kv:
        return []
    lines = [
        "",
        f"KV cache dtypes in the same memory ({kv['memory_bytes'] / 2**20:.1f} MiB: {kv['basis']}, model "
        f"{kv['model']}), block size {kv['block_size']}:",
        "",
        "| KV cache dtype | bytes per block | blocks | blocks vs first | steps (saturated) "
        "| concurrent seqs mean / max at saturation | concurrency vs first | preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in kv["rows"]:
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['bytes_per_block']:,} | {r['num_kv_blocks']:,} "
            f"| {_times(r['blocks_ratio'])} | {r['steps']} ({r['saturated_steps']}) "
            f"| {_num(r['concurrent_mean'])} / {_num(r['concurrent_max'], 'd')} "
            f"| {_times(r['concurrency_ratio'])} | {r['preemptions']} |"
        )
    checked = [r for r in kv["rows"] if "engine_identical_to_simulation" in r]
    if checked:
        lines += ["", "Engine cross-check per KV cache dtype, every step identical to the simulation: " + ", ".join(
            f"{r['kv_cache_dtype']} {'yes' if r['engine_identical_to_simulation'] else 'NO'}" for r in checked
        ) + "."]
    return lines


def _goal_lines(report: dict[str, Any]) -> list[str]:
    """Per block size: whether the waste and concurrency goals are met."""
    lines = []
    for p in report["paged"]:
        waste = {True: "met", False: "not met", None: "n/a (never saturated)"}[p["goal_waste_met"]]
        conc = {True: "met", False: "not met", None: "n/a"}[p["goal_concurrency_met"]]
        lines.append(
            f"Goals at block size {p['block_size']}: KV waste {_pct(p['kv_waste'])} <= unavoidable "
            f"{_pct(p['unavoidable_waste'])}: {waste}; concurrency {_times(p['ratio_vs_max_len'])} the "
            f"max-length contiguous allocator (goal >= {GOAL_CONCURRENCY_RATIO:g}x): {conc}."
        )
    return lines


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # K and V, bf16
