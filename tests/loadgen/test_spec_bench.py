"""The speculative decoding benchmark: its copy workload and both of its measurements, on the tiny model."""

from __future__ import annotations

import json

import torch

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


def test_copy_run_with_a_draft_model_cut_from_the_model(tmp_path):
    """The draft checkpoint helper cuts the model's first layers into a folder; with all but one of
    the tiny model's 4 layers the draft is often right, and the outputs stay the model's."""
    from mqinfer.loadgen import draft_checkpoint
    from mqinfer.workers.engine.loader import load_model, save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / "tiny")
    assert draft_checkpoint.main(["--model", str(folder), "--layers", "3", "--out", str(tmp_path / "d")]) == 0
    draft, info = load_model(str(tmp_path / "d"))
    assert (info.num_layers, info.vocab_size, info.dtype) == (3, 264, "float32")
    full = load_model("tiny")[0].state_dict()
    kept = draft.state_dict()
    assert kept and all(not k.startswith("model.layers.3.") for k in kept)
    assert all(torch.equal(v, full[k]) for k, v in kept.items())
    out = tmp_path / "draft.json"
    assert spec_bench.main(["--model", "tiny", "--num-requests", "1", "--max-tokens", "8", "--dtype", "float32",
                            "--speculative", "draft", "--draft-model", str(tmp_path / "d"), "--speculative-policy",
                            "fixed", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["speculative"] == "draft" and report["draft_model"].startswith("d@")
    assert report["draft_layers"] is None and report["identical_outputs"] == "1/1"
    assert report["proposed_tokens"] > 0
