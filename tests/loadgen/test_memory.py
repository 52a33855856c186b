"""The KV memory report: waste and concurrency from the real scheduler, checked on workloads small
enough to work out by hand, the contiguous allocators' admission rules, and the command line."""

from __future__ import annotations

import json

import pytest

from mqinfer.loadgen.memory import (
    StepSample,
    main,
    memory_report,
    run_engine_paged,
    run_paged,
    simulate_contiguous,
    summarize_samples,
)
from mqinfer.loadgen.workload import shared_prefix_workload, uniform_workload


def _req(i: int, prompt_len: int, max_tokens: int) -> dict:
    return {"id": f"r{i}", "prompt_token_ids": [3 + (i * 7 + k) % 50 for k in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}


def test_block_aligned_prompts_waste_only_the_decode_partial_block():
    # Block size 4, 6 blocks (24 slots); four requests of 8 prompt tokens (two full blocks) and 2 outputs.
    # Step 1: r0 takes 2 blocks; r1 needs 2 + 1 kept free for r0 = 3 <= 4 free; r2 needs 2 + 2 > 2: refused.
    #   Held 16 in 16 slots: no waste. Saturated (2 waiting, admission stopped for lack of blocks).
    # Step 2: r0 and r1 each write token 9, a third block each (24 slots, 18 tokens): waste 6/24.
    #   Saturated; both finish. Steps 3 and 4 repeat for r2, r3 with nobody waiting: not saturated.
    requests = [_req(i, 8, 2) for i in range(4)]
    run = run_paged(requests, 4, 24, max_model_len=64)
    assert run.num_kv_blocks == 6 and run.num_preemptions == 0
    assert run.samples == [
        StepSample(16, 16, 16, 2, True, 16),
        StepSample(24, 18, 24, 2, True, 18),
        StepSample(16, 16, 16, 2, False, 16),
        StepSample(24, 18, 24, 2, False, 18),
    ]
    s = summarize_samples(run.samples, 24, 4)
    assert s["saturated_steps"] == 2
    assert s["kv_waste"] == pytest.approx((0 + 6 / 24) / 2)
    assert s["unavoidable_waste"] == pytest.approx(s["kv_waste"])
    assert s["concurrent_mean"] == 2 and s["concurrent_max"] == 2
    assert s["kv_usage"] == pytest.approx((16 / 24 + 1) / 2)


def test_prompt_only_requests_in_whole_blocks_waste_nothing():
    # max_tokens 1: each request lives one step, holding exactly its 8 prompt tokens in 2 blocks.
    # 4 blocks: r0 takes 2, r1 needs 2 + 1 reserved > 2 free: one request per step, 6 steps.
    run = run_paged([_req(i, 8, 1) for i in range(6)], 4, 16, max_model_len=64)
    assert [(s.allocated_slots, s.held_tokens, s.num_running) for s in run.samples] == [(8, 8, 1)] * 6
    assert [s.saturated for s in run.samples] == [True] * 5 + [False]
    s = summarize_samples(run.samples, 16, 4)
    assert s["kv_waste"] == 0 and s["unavoidable_waste"] == 0 and s["concurrent_mean"] == 1


def test_steps_capped_by_max_num_seqs_are_not_saturated():
    # Plenty of KV but two sequences at most: requests wait, but not for lack of blocks.
    run = run_paged([_req(i, 5, 3) for i in range(6)], 4, 4096, max_model_len=64, max_num_seqs=2,
                    max_num_batched_tokens=64)
    assert max(s.num_running for s in run.samples) == 2
    assert not any(s.saturated for s in run.samples)
    assert summarize_samples(run.samples, 4096, 4)["kv_waste"] is None
    # Nor when the step's token budget is spent: 8 tokens a step, prompts of 5.
    run = run_paged([_req(i, 5, 3) for i in range(6)], 4, 4096, max_model_len=64, max_num_seqs=8,
                    max_num_batched_tokens=8)
    assert run.samples[0].num_running == 2  # 5 tokens, then a 3-token chunk of the next prompt
    assert not any(s.saturated for s in run.samples)


def test_paged_waste_is_the_last_partial_block_on_a_random_workload():
    requests = uniform_workload(48, prompt_len=(5, 90), output_len=(3, 40), seed=7)
    for bs in (8, 16, 32):
        run = run_paged(requests, bs, 1024, max_model_len=256)
        sat = [s for s in run.samples if s.saturated]
        assert len(sat) > 10
        for s in run.samples:
            assert s.allocated_slots <= 1024 and s.held_tokens <= s.allocated_slots
            # No sequence holds a block beyond the one its last token is in.
            assert s.allocated_slots == s.min_slots
            assert s.allocated_slots - s.held_tokens < bs * max(1, s.num_running)
        # Every prompt and output token passed through: the run really ran the workload.
        assert sum(1 for s in run.samples if s.num_running) >= max(r["max_tokens"] for r in requests)


def test_contiguous_max_length_concurrency_is_budget_over_max_model_len():
    requests = uniform_workload(40, prompt_len=(4, 30), output_len=(2, 30), seed=3)
    run = simulate_contiguous(requests, 5 * 64 + 63, lambda p, o: 64)
    sat = [s for s in run.samples if s.saturated]
    assert sat and all(s.num_running == 5 for s in sat)
    assert all(s.allocated_slots == 5 * 64 for s in sat)
    # Every request gets one step per output token; five at a time, in order.
    assert sum(s.num_running for s in run.samples) == sum(r["max_tokens"] for r in requests)


def test_contiguous_first_fit_fragments_where_the_sum_rule_does_not():
    # Budget 10. A (size 3, 1 step), B (size 4, 3 steps), C (size 3, 1 step) fill [0,3) [3,7) [7,10);
    # D (size 5) waits. After A and C end there are 6 free slots but in two holes of 3: first fit
    # keeps D out until B ends, the sum rule lets it in at once.
    requests = [_req(0, 2, 1), _req(1, 1, 3), _req(2, 2, 1), _req(3, 3, 2)]
    exact = lambda p, o: p + o  # noqa: E731
    ff = simulate_contiguous(requests, 10, exact, fit="first-fit")
    assert [(s.num_running, s.allocated_slots, s.saturated) for s in ff.samples] == [
        (3, 10, True), (1, 4, True), (1, 4, True), (1, 5, False), (1, 5, False)]
    # Held: prompt + outputs so far; A and C hold their 2-token prompts, B 1 then 2 then 3.
    assert [s.held_tokens for s in ff.samples] == [5, 2, 3, 3, 4]
    sm = simulate_contiguous(requests, 10, exact, fit="sum")
    assert [(s.num_running, s.saturated) for s in sm.samples] == [(3, True), (2, False), (2, False)]
    assert summarize_samples(ff.samples, 10, None)["concurrent_mean"] == pytest.approx(5 / 3)
    assert summarize_samples(sm.samples, 10, None)["concurrent_mean"] == 3


def test_contiguous_reservation_larger_than_the_budget_never_fits():
    run = simulate_contiguous([_req(0, 4, 4)], 100, lambda p, o: 128)
    assert run.never_fits and run.samples == []
    with pytest.raises(ValueError, match="cannot hold"):
        simulate_contiguous([_req(0, 40, 4)], 100, lambda p, o: 16)


def test_report_ratios_and_goals():
    requests = uniform_workload(64, prompt_len=(16, 64), output_len=(8, 32), seed=1)
    report = memory_report(requests, kv_budget=2048, block_sizes=(8, 16), max_model_len=256)
    assert report["contiguous"]["max_len"]["concurrent_mean"] == 8  # 2048 // 256
    for p in report["paged"]:
        assert p["kv_slots"] == 2048 and p["saturated_steps"] > 0
        assert p["kv_waste"] == pytest.approx(p["unavoidable_waste"])
        assert p["ratio_vs_max_len"] == pytest.approx(p["concurrent_mean"] / 8)
        assert p["goal_waste_met"] is True
        assert p["goal_concurrency_met"] is (p["ratio_vs_max_len"] >= 4)
    # Larger blocks: more slots wasted per sequence.
    assert report["paged"][0]["kv_waste"] < report["paged"][1]["kv_waste"]
    with pytest.raises(ValueError, match="max_model_len"):
        memory_report(requests, kv_budget=2048, block_sizes=(16,), max_model_len=40)


def test_prefix_caching_counts_shared_blocks_once():
    # Two 128-token prefixes (8 blocks of 16) shared by 48 requests with short suffixes.
    requests = shared_prefix_workload(48, num_prefixes=2, prefix_len=128, suffix_len=(8, 32), output_len=(4, 16),
                                      seed=2)
    off = run_paged(requests, 16, 2048, max_model_len=512)
    on = run_paged(requests, 16, 2048, max_model_len=512, prefix_caching=True)
    assert all(s.sequence_tokens == s.held_tokens for s in off.samples)
    # Shared blocks are held once: the sequences have more tokens than the cache holds.
    assert any(s.sequence_tokens >= s.held_tokens + 128 for s in on.samples)
    for s in on.samples:
        assert s.held_tokens <= s.allocated_slots <= 2048
        assert s.allocated_slots == s.min_slots  # still only the last partial blocks are empty
    mean = lambda run: summarize_samples(run.samples, 2048, 16)["concurrent_mean"]  # noqa: E731
    assert mean(on) > 1.3 * mean(off)


def test_the_real_engine_gives_the_same_steps_as_the_simulation():
    requests = uniform_workload(10, prompt_len=(4, 40), output_len=(2, 12), vocab_size=256, seed=5)
    sim = run_paged(requests, 8, 160, max_model_len=256)
    eng = run_engine_paged(requests, 8, 160, model="tiny", max_model_len=256, num_threads=1)
    assert any(s.saturated for s in sim.samples)
    assert eng.samples == sim.samples


def test_cli_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "memory.json"
    code = main(["--num-requests", "40", "--kv-budget", "1024", "--block-sizes", "8,32", "--max-model-len", "512",
                 "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| block size |" in text and "| contiguous allocator |" in text
    assert "Goals at block size 8" in text and "Goals at block size 32" in text
    data = json.loads(out.read_text())
    assert [p["block_size"] for p in data["paged"]] == [8, 32]
    assert data["kv_budget_tokens"] == 1024 and data["max_model_len"] == 512
    assert data["contiguous"]["max_len"]["concurrent_mean"] == 2
    assert data["workload"]["num_requests"] == 40 and data["workload"]["name"] == "standard"
    assert data["command"].endswith("--json " + str(out))
    assert f"{data['paged'][0]['kv_waste']:.2%}" in text


def test_cli_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--kv-budget" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--block-sizes", "8,x"])
    with pytest.raises(SystemExit):
        main(["--kv-budget", "4", "--block-sizes", "16"])


def test_kv_cache_dtypes_compare_blocks_and_concurrency_in_the_same_memory(tmp_path, capsys):
    out = tmp_path / "memory.json"
    code = main(["--num-requests", "40", "--kv-budget", "1024", "--block-sizes", "16", "--max-model-len", "512",
                 "--kv-cache-dtypes", "auto,int8", "--json", str(out)])
    assert code == 0
    assert "| KV cache dtype |" in capsys.readouterr().out
    kv = json.loads(out.read_text())["kv_cache_dtypes"]
    auto, int8 = kv["rows"]
    # The tiny model: 1024 slots of float32 KV (4096 bytes a token) = 4 MiB; 8-bit with bfloat16
    # scales takes 1056 bytes a token, so 248 blocks of 16 fit where float32 has 64.
    assert kv["memory_bytes"] == 1024 * 4096 and kv["model"] == "tiny"
    assert (auto["num_kv_blocks"], int8["num_kv_blocks"]) == (64, (4 << 20) // (1056 * 16)) == (64, 248)
    assert int8["bytes_per_block"] == 1056 * 16 and int8["blocks_ratio"] == pytest.approx(248 / 64)
    assert auto["saturated_steps"] > 0 and int8["concurrent_mean"] > 3 * auto["concurrent_mean"]
    assert int8["concurrency_ratio"] == pytest.approx(int8["concurrent_mean"] / auto["concurrent_mean"])
    with pytest.raises(SystemExit):
        main(["--kv-cache-dtypes", "auto,int4"])
