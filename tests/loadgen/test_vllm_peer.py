"""`mqinfer bench --compare vllm`: its flags, the core list vLLM binds to, and a run whose Python has
no vLLM (this project's own: vLLM's CPU build is too large to install for the tests) ending as a
recorded failure, not a crash of the bench."""

from __future__ import annotations

import argparse
import sys

from mqinfer.loadgen import vllm_peer


def _args(**kw) -> argparse.Namespace:
    base = {"compare": ["vllm"], "vllm_python": None, "mode": "offline", "dtype": "float32", "timeout_s": 120.0}
    return argparse.Namespace(**{**base, **kw})


def test_flags_say_what_is_missing(tmp_path):
    assert "needs --vllm-python PATH" in vllm_peer.check_flags(_args())
    assert "no such file" in vllm_peer.check_flags(_args(vllm_python=str(tmp_path / "nope")))
    assert "offline" in vllm_peer.check_flags(_args(vllm_python=sys.executable, mode="online"))
    assert vllm_peer.check_flags(_args(vllm_python=sys.executable)) is None
    assert "--compare vllm only" in vllm_peer.check_flags(_args(compare=["hf"], vllm_python=sys.executable))
    assert vllm_peer.check_flags(_args(compare=None)) is None


def test_core_lists_in_vllms_form():
    assert vllm_peer.cpu_list([0, 1]) == "0-1"
    assert vllm_peer.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert vllm_peer.cpu_list([3]) == "3"
    env = vllm_peer.environment({"VLLM_CPU_SGL_KERNEL": "1"}, sys.executable)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_SGL_KERNEL"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_peer.cpu_list(vllm_peer.cores())


def test_a_python_without_vllm_is_a_recorded_failure(tmp_path):
    requests = [{"prompt_token_ids": [1, 2, 3], "max_tokens": 4}, {"prompt_token_ids": [4, 5], "max_tokens": 2}]
    report, row = vllm_peer.compare(_args(vllm_python=sys.executable), tmp_path / "model", requests, 8, tmp_path)
    assert row is None and report["best"] is None and len(report["runs"]) == 2
    assert all("No module named 'vllm'" in run["error"] for run in report["runs"])
    spec = (tmp_path / "vllm" / "vllm-vllm_cpu_sgl_kernel=0-in.json").read_text()
    assert '"max_model_len": 7' in spec and '"max_num_seqs": 8' in spec


def test_vllm_runs_with_its_own_environment_first_on_path_not_an_activated_one(monkeypatch, tmp_path):
    """vLLM starts helper processes by interpreter name: under mqinfer's activated venv they must
    still find vLLM's interpreter first."""
    from mqinfer.loadgen.vllm_peer import environment

    ours, theirs = tmp_path / "ours", tmp_path / "vllm"
    for venv in (ours, theirs):
        (venv / "bin").mkdir(parents=True)
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    monkeypatch.setenv("VIRTUAL_ENV", str(ours))
    monkeypatch.setenv("PATH", f"{ours / 'bin'}:/usr/bin")
    env = environment({"VLLM_CPU_SGL_KERNEL": "1"}, str(theirs / "bin" / "python"))
    assert env["PATH"].split(":") == [str(theirs / "bin"), "/usr/bin"]
    assert env["VIRTUAL_ENV"] == str(theirs) and env["VLLM_CPU_SGL_KERNEL"] == "1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
