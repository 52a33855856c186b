"""The speculative decoding benchmark: its copy workload and both of its measurements, on the tiny model."""

from __future__ import annotations

import json

from mqinfer.loadgen import spec_bench


def test_copy_tasks_ask_to_copy_text_from_the_prompt():
    tasks = spec_bench.copy_tasks(6)
    assert len(tasks) == 6
    prompts = [t[0]["content"] for t in tasks]
    assert prompts[0].startswith("Repeat the following text exactly")
    assert prompts[1].startswith("Rename the function") and "def " in prompts[1]
    assert prompts[2].startswith("Write each sentence")
    assert len(set(prompts)) == 6 and all(len(p) > 200 for p in prompts)


def test_copy_run_and_step_sweep_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "copy.json"
    assert spec_bench.main(["--model", "tiny", "--num-requests", "2", "--max-tokens", "12", "--dtype", "float32",
                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identical_outputs"] == "2/2"
    assert set(report["ms_per_output_token"]) == {"none", "ngram"} and report["speedup"] > 0
    assert "time per output token: none" in capsys.readouterr().out
    sweep = tmp_path / "sweep.json"
    assert spec_bench.main(["--model", "tiny", "--step-sweep", "--batch-sizes", "2", "--sweep-steps", "1",
                            "--json", str(sweep)]) == 0
    rows = json.loads(sweep.read_text())["steps"]
    assert [(r["batch"], r["query_tokens"]) for r in rows] == [(2, 2), (2, 4), (2, 8), (2, 16)]
    assert all(r["step_ms"] > 0 for r in rows)


def test_copy_run_with_self_speculation_on_the_tiny_model(tmp_path):
    out = tmp_path / "self.json"
    assert spec_bench.main(["--model", "tiny", "--num-requests", "1", "--max-tokens", "8", "--dtype", "float32",
                            "--speculative", "self", "--draft-layers", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["speculative"] == "self" and report["draft_layers"] == 3
    assert set(report["ms_per_output_token"]) == {"none", "self"} and report["identical_outputs"] == "1/1"
    assert report["proposed_tokens"] > 0
