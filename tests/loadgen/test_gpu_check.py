"""`python -m mqinfer.loadgen.gpu.check`: without a GPU it says so and exits 0; every case runs on
the CPU at small sizes (the Triton kernels interpreted) and passes; a wrong kernel makes its row
FAIL and the exit status 1; the table and exit-status rules; rows that need two GPUs."""

from __future__ import annotations

import os

# Before triton is imported anywhere in this process: @triton.jit picks the interpreter at
# decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import json

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from mqinfer.kernels import linear_int8, triton_attention, triton_attention_kernels, triton_store  # noqa: E402
from mqinfer.loadgen.gpu import check as gpu_check  # noqa: E402
from mqinfer.loadgen.gpu import check_cases as cases  # noqa: E402

if type(triton_attention_kernels.paged_attention_kernel).__name__ != "InterpretedFunction":
    # Decorated before TRITON_INTERPRET was set: decorate again under the interpreter (the
    # cases look the module up at call time, so they get these).
    importlib.reload(triton_store)
    importlib.reload(triton_attention_kernels)
    importlib.reload(triton_attention)

SMALL = ["--device", "cpu", "--small"]


@pytest.fixture(autouse=True)
def one_model_thread(monkeypatch):
    """The cases build their engines in this process without a thread count, so they take
    OMP_NUM_THREADS's: one, as for every worker the tests start. With a thread per core, each
    small step waits on threads that other test processes hold (a case of one second took
    twenty on two busy cores); what the cases check (the same tokens as the reference) does not
    depend on the thread count."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_gpu_it_says_so_and_exits_0_with_nothing_run(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    assert "gpu_check: no CUDA device: nothing run" in capsys.readouterr().out
    body = json.loads(out.read_text())
    assert body["rows"] == [] and body["exit_code"] == 0 and body["environment"]["reason"] == "no CUDA device"


def test_every_case_runs_on_the_cpu_and_passes(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main([*SMALL, "--json", str(out), "--workdir", str(tmp_path / "work")]) == 0, \
        capsys.readouterr().out
    body = json.loads(out.read_text())
    results = {r["case"]: r["result"] for r in body["rows"]}
    assert list(results) == [name for name, _ in gpu_check.case_list()]
    expected = {name: "ok" for name in results}
    expected["triton kernels bfloat16"] = "skipped"  # the interpreter has no bfloat16
    if not cases.pipeline_built():
        expected["pipeline parallel P=2"] = "not built"
    assert results == expected
    assert body["finished"] is True and body["exit_code"] == 0
    assert body["environment"]["device"] == "cpu" and body["environment"]["torch"] == torch.__version__
    details = {r["case"]: r["detail"] for r in body["rows"]}
    assert "int8: store exact" in details["triton 8-bit KV store + attention"]
    assert "fp8: store exact" in details["triton 8-bit KV store + attention"]
    assert "int32 sums exact on 3/3 shapes" in details["w8a8 int8 matmul (torch._int_mm)"]
    assert "bfloat16 exact, int8 exact, fp8 exact" in details["swap: host blocks (pinned)"]
    assert "6/6 rows of 8 tokens, 6 cost rows" in details["mqinfer run tiny"]
    assert "random-weight Llama" in details["mqinfer run checkpoint"]
    # The printed table has every row.
    printed = capsys.readouterr().out
    assert all(name in printed for name in results) and "14 of 14 rows passed" in printed


def test_a_wrong_int8_matmul_fails_its_row_and_the_exit_status(tmp_path, monkeypatch, capsys):
    real = linear_int8.int_matmul
    monkeypatch.setattr(linear_int8, "int_matmul", lambda qx, qw: real(qx, qw) + (qx.shape[0] > 16))
    out = tmp_path / "check.json"
    code = gpu_check.main([*SMALL, "--only", "w8a8 int8 matmul (torch._int_mm)", "--json", str(out)])
    assert code == 1
    [row] = json.loads(out.read_text())["rows"]
    assert row["result"] == "FAIL" and "int32 sums exact on 1/3 shapes" in row["detail"]
    assert "FAILED: w8a8 int8 matmul (torch._int_mm)" in capsys.readouterr().out


def test_a_store_that_drops_a_token_fails_the_8bit_row(tmp_path, monkeypatch):
    real = triton_attention.store_kv

    def drops_last(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        real(k[:-1], v[:-1], k_cache, v_cache, slot_mapping[:-1], k_scale, v_scale)

    monkeypatch.setattr(triton_attention, "store_kv", drops_last)
    setup = cases.Setup(device="cpu", small=True, workdir=tmp_path, gpu_count=0)
    outcome = cases.triton_kv8(setup)
    assert not outcome.ok and "int8: store DIFFERS" in outcome.detail and "fp8: store DIFFERS" in outcome.detail


def test_rows_that_need_two_gpus_say_so_on_one(tmp_path, monkeypatch):
    one_gpu = cases.Setup(device="cuda", small=False, workdir=tmp_path, gpu_count=1)
    row = gpu_check.run_case("tensor parallel T=2", cases.tensor_parallel, one_gpu)
    assert (row.result, row.detail) == ("skipped", "1 GPU: needs 2")
    monkeypatch.setattr(cases, "pipeline_built", lambda: False)
    row = gpu_check.run_case("pipeline parallel P=2", cases.pipeline_parallel, one_gpu)
    assert (row.result, row.detail) == ("not built", "this build has no --pipeline-parallel-size")
    monkeypatch.setattr(cases, "pipeline_built", lambda: True)
    assert gpu_check.run_case("p", cases.pipeline_parallel, one_gpu).result == "skipped"


def test_rows_and_exit_status():
    def passes(setup):
        return cases.Outcome(True, "all equal")

    def mismatches(setup):
        return cases.Outcome(False, "3 differ")

    def breaks(setup):
        raise RuntimeError("CUDA error: an illegal memory access")

    def not_built(setup):
        raise cases.Skip("not built", "no such option")

    rows = [gpu_check.run_case(name, fn, None) for name, fn in
            (("a", passes), ("b", mismatches), ("c", breaks), ("d", not_built))]
    assert [r.result for r in rows] == ["ok", "FAIL", "ERROR", "not built"]
    assert rows[2].detail.startswith("RuntimeError: CUDA error: an illegal memory access (at test_gpu_check.py:")
    assert all(r.seconds >= 0 for r in rows)
    table = gpu_check.format_table(rows).splitlines()
    assert table[0].split() == ["case", "result", "time", "detail"]
    assert table[2].split()[:2] == ["b", "FAIL"] and table[2].endswith("3 differ")
    assert gpu_check.exit_code([rows[0], rows[3]]) == 0
    assert gpu_check.exit_code(rows[:2]) == 1 and gpu_check.exit_code([rows[0], rows[2]]) == 1
    assert gpu_check.exit_code([]) == 0
    with pytest.raises(ValueError, match="unknown results"):
        gpu_check.exit_code([gpu_check.Row("x", "maybe", 0.0, "")])


def _output(tokens, logprobs, alternatives):
    return tokens, [{"logprob": lp, "top_token_ids": [t for t, _ in alt], "top_logprobs": [p for _, p in alt]}
                    for lp, alt in zip(logprobs, alternatives)]


def test_agreement_allows_a_first_difference_only_on_a_near_tie():
    alts = [[(5, -1.0), (6, -1.0005)], [(7, -0.5), (8, -2.0)], [(9, -0.1), (3, -3.0)]]
    base = {"r": _output([5, 7, 9], [-1.0, -0.5, -0.1], alts)}
    same = cases.agreement(base, {"r": _output([5, 7, 9], [-1.0002, -0.5, -0.1], alts)}, tie=1e-3)
    assert same.share == 1.0 and same.worst == pytest.approx(2e-4) and same.off_tie == 0
    # Token 6 was 5e-4 behind 5: a near tie within 1e-3, not within 1e-4.
    flip = {"r": _output([6, 1, 1], [-1.0, -9.0, -9.0], alts)}
    assert cases.agreement(base, flip, tie=1e-3) == cases.Agreement(0.0, 0.0, 0)
    assert cases.agreement(base, flip, tie=1e-4).off_tie == 1
    # Token 8 was 1.5 behind: never a tie at these tolerances; two tokens agreed first.
    wrong = cases.agreement(base, {"r": _output([5, 8, 9], [-1.0, -2.0, -0.1], alts)}, tie=0.3)
    assert wrong.share == pytest.approx(1 / 3) and wrong.off_tie == 1
    ok, detail = cases.judged("x", wrong, tol=0.1, tie=0.3)
    assert not ok and "1 first difference(s) off a near tie" in detail


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit, match="no case named 'nope'"):
        gpu_check.main([*SMALL, "--only", "nope"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--model", "/no/such/checkpoint"])
    assert "--model /no/such/checkpoint: no such file or folder" in capsys.readouterr().err
