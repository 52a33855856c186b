"""`python -m mqinfer.loadgen.gpu.bench`: the CPU dry run of every phase (gpu_check, bandwidth,
the pipeline, transformers, the decode roofs, the online rates) on the tiny model, so the
command cannot rot; the time budget skips what it has no time for and still prints a summary;
the roof arithmetic and the goals against hand-computed figures; bad arguments are refused."""

from __future__ import annotations

import json

import pytest
import torch

from mqinfer.loadgen.gpu import bench as gpu_bench
from mqinfer.loadgen.gpu.bench_roofs import DeviceBandwidth, decode_roof, step_bytes
from mqinfer.loadgen.gpu.bench_run import summary_rows

DRY = ["--device", "cpu", "--models", "tiny", "--num-requests", "2", "--hf-batch-sizes", "2", "--roof-batch", "2",
       "--roof-context", "16", "--roof-steps", "3", "--online-requests", "2"]


@pytest.fixture(autouse=True)
def one_model_thread(monkeypatch):
    """The in-process engine and transformers take OMP_NUM_THREADS's thread count: one, as the
    workers the tests start, so small steps do not wait on threads other test processes hold."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_the_cpu_dry_run_measures_every_phase_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gpu_bench.json"
    assert gpu_bench.main([*DRY, "--json", str(out), "--workdir", str(tmp_path / "work")]) == 0
    body = json.loads(out.read_text())
    assert body["finished"] is True and body["dtype"] == "float32"
    assert body["gpu_check"]["exit_code"] == 0  # no CUDA here: it says so and runs nothing
    assert body["bandwidth"]["bytes_per_s"] > 0
    tiny = body["models"]["tiny"]
    for phase in ("pipeline", "transformers", "decode_roofs", "online"):
        assert tiny[phase]["status"] == "ok", (phase, tiny[phase])
    assert tiny["pipeline"]["summary"]["num_requests"] == 2 and tiny["pipeline"]["throughput"] > 0
    assert tiny["transformers"]["static_best_batch"] == 2 and tiny["transformers"]["static_best_throughput"] > 0
    for key, batch in (("batch_1", 1), ("batch_n", 2)):
        roof = tiny["decode_roofs"][key]
        assert roof["batch"] == batch and roof["step_s"] > 0 and roof["roof_s"] > 0
        assert roof["over_roof"] == pytest.approx(roof["step_s"] / roof["roof_s"])
    points = tiny["online"]["points"]
    assert [p["fraction"] for p in points] == [0.25, 0.5]
    assert points[1]["rate"] == pytest.approx(2 * points[0]["rate"], rel=1e-4)
    assert all(p["summary"]["num_requests"] == 2 and p["ttft_p50_s"] > 0 for p in points)
    row = body["summary"]["tiny"]
    assert row["vs_hf_static"] == pytest.approx(row["mqinfer_tok_s"] / row["hf_static_best_tok_s"])
    printed = capsys.readouterr().out
    assert "tiny:" in printed and "vs hf static" in printed and "TTFT p50" in printed and "goals" in printed


def test_a_spent_budget_skips_the_models_and_still_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "gpu_bench.json"
    code = gpu_bench.main([*DRY, "--models", "tiny,standard", "--skip-gpu-check", "--budget-s", "0.01",
                           "--json", str(out), "--workdir", str(tmp_path / "work")])
    assert code == 0  # skipping for the budget is no failure
    body = json.loads(out.read_text())
    assert body["finished"] is True and body["gpu_check"]["status"].startswith("not run")
    assert body["models"] == {"tiny": {"status": gpu_bench.SKIPPED}, "standard": {"status": gpu_bench.SKIPPED}}
    assert not (tmp_path / "work" / "standard").exists()  # no checkpoint written for a skipped model
    assert "budget spent" in capsys.readouterr().out


def test_the_decode_roof_counts_weights_once_and_the_batch_kv():
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}
    # Per layer: q 64*64 + k,v 2*64*32 + o 64*64 + MLP 3*64*128 = 36864; two layers and the LM head
    # 100*64, two bytes each in bfloat16.
    weights = 2 * (2 * 36864 + 100 * 64)
    kv_token = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x KV heads x head_dim x bfloat16 bytes
    assert step_bytes(config, "bfloat16", 8, 10) == weights + 8 * 10 * kv_token
    bandwidth = DeviceBandwidth("cpu", 1e9, 1 << 20, "hand-made")
    need = weights + 8 * 10 * kv_token
    roof = decode_roof(config, "bfloat16", 8, 10, step_s=4 * need / 1e9, bandwidth=bandwidth)
    assert roof.roof_s == pytest.approx(need / 1e9)
    assert roof.over_roof == pytest.approx(4.0) and roof.bandwidth_share == pytest.approx(0.25)
    with pytest.raises(ValueError):
        decode_roof(config, "bfloat16", 1, 1, step_s=0.0, bandwidth=bandwidth)


def test_the_goals_are_judged_from_the_measured_figures():
    body = {"models": {
        "fast": {"pipeline": {"status": "ok", "throughput": 6000.0},
                 "transformers": {"status": "ok", "static_best_throughput": 1000.0, "continuous_throughput": 5000.0},
                 "decode_roofs": {"status": "ok", "batch_1": {"bandwidth_share": 0.55},
                                  "batch_n": {"over_roof": 1.4, "batch": 256}}},
        "slow": {"pipeline": {"status": "ok", "throughput": 4000.0},
                 "transformers": {"status": "ok", "static_best_throughput": 1000.0, "continuous_throughput": 5000.0},
                 "decode_roofs": {"status": "skipped: time budget spent"}},
        "failed": {"pipeline": {"status": "error", "throughput": 9.0}},
    }}
    rows = summary_rows(body)
    assert rows["fast"]["vs_hf_static"] == pytest.approx(6.0)
    assert all(rows["fast"]["goals"].values())
    slow = rows["slow"]["goals"]
    assert slow["5x hf static"] is False and slow["ahead of hf continuous"] is False
    assert slow["batch 1 >= 50% of bandwidth"] is None and slow["batch-N step <= 1.5x roof"] is None
    assert rows["failed"]["mqinfer_tok_s"] is None  # a failed phase's figures do not count


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_how_to_dry_run_and_exits_2(tmp_path, capsys):
    assert gpu_bench.main(["--json", str(tmp_path / "x.json")]) == 2
    assert "--device cpu" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv", [["--models", "7b"], ["--models", ","], ["--online-rates", "0"],
                                  ["--online-rates", "1.5"], ["--hf-batch-sizes", "0"], ["--budget-s", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_bench.main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_gpu_session_script_runs_gpu_bench_and_prints_its_summary(tmp_path):
    """The script a GPU session runs, here on the CPU with a budget that is spent at once: the
    machine report, gpu_bench's exit status, and the summary read back from its JSON."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DEVICE": "cpu", "MODELS": "tiny", "BUDGET_S": "1", "PYTHON": sys.executable,
           "EXTRA": "--skip-gpu-check --num-requests 2"}
    out = subprocess.run(["bash", str(root / "loadgen" / "gpu_session.sh"), str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== machine" in out.stdout and "torch " in out.stdout
    assert "== gpu_bench exit status 0" in out.stdout and '"summary"' in out.stdout
    body = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert body["finished"] is True and body["environment"]["device"] == "cpu"
