"""llama.cpp as a peer: its result table, settings line, GGUF shape, command line and runs.

The samples are real output of llama-batched-bench (built from llama-cpp-python 0.3.36's vendored
llama.cpp, SmolLM2-135M in bf16, stdout and stderr together as the bench reads them). No test
needs llama.cpp: the runs go through a stand-in script that prints such output.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from mqinfer.loadgen import llamacpp
from mqinfer.loadgen.bench_model import ModelSpec
from tests.loadgen.llamacpp_fakes import make_stand_in, tiny_llama_gguf

# llama-batched-bench -c 96 -b 96 -ub 96 -npp 16 -ntg 8 -npl 4 -t 1 -tb 1 -fa on
SAMPLE = """\
0.00.453.539 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 1024

llama_batched_bench: n_kv_max = 1024, n_batch = 96, n_ubatch = 96, flash_attn = 1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    4 |     96 |    0.791 |    80.92 |    1.113 |    28.76 |    1.904 |    50.43 |

"""

# llama-batched-bench -c 64 -b 64 -ub 64 -npp 8 -ntg 4 -npl 1,2 -t 2 -tb 2 -fa on
SAMPLE_TWO_ROWS = """\
0.00.595.107 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 512

llama_batched_bench: n_kv_max = 512, n_batch = 64, n_ubatch = 64, flash_attn = 1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    1 |     12 |    0.067 |   119.34 |    0.540 |     7.41 |    0.607 |    19.78 |
|     8 |      4 |    2 |     24 |    0.488 |    32.79 |    0.893 |     8.95 |    1.381 |    17.37 |

"""


def test_the_result_rows_of_real_output():
    [row] = llamacpp.parse_batched_bench(SAMPLE)
    assert row == llamacpp.BatchedBenchRow(pp=16, tg=8, b=4, n_kv=96, t_pp_s=0.791, s_pp_tok_s=80.92, t_tg_s=1.113,
                                           s_tg_tok_s=28.76, t_s=1.904, s_tok_s=50.43)
    # S is every token over the total time: (4 * 16 + 4 * 8) / 1.904 s.
    assert row.s_tok_s == pytest.approx((4 * 16 + 4 * 8) / row.t_s, rel=1e-3)
    rows = llamacpp.parse_batched_bench(SAMPLE_TWO_ROWS)
    assert [(r.pp, r.tg, r.b, r.n_kv, r.s_tok_s) for r in rows] == [(8, 4, 1, 12, 19.78), (8, 4, 2, 24, 17.37)]
    assert llamacpp.parse_settings(SAMPLE) == {
        "n_kv_max": 1024, "n_batch": 96, "n_ubatch": 96, "flash_attn": 1, "is_pp_shared": 0, "is_tg_separate": 0,
        "n_gpu_layers": -1, "n_threads": 1, "n_threads_batch": 1}
    assert llamacpp.parse_settings("no settings here") == {}


def test_broken_output_is_a_clear_error():
    with pytest.raises(ValueError, match="no llama-batched-bench result table"):
        llamacpp.parse_batched_bench("error: unable to load model\n")
    assert llamacpp.parse_batched_bench(SAMPLE.split("|    16")[0]) == []  # a header and no row (context too small)
    with pytest.raises(ValueError, match=r"line 7: T_PP s is 'nan\?', not a number"):
        llamacpp.parse_batched_bench(SAMPLE.replace("0.791", "nan? "))
    with pytest.raises(ValueError, match="has 9 cells, the header 10"):
        llamacpp.parse_batched_bench(SAMPLE.replace("|    50.43 |", "|"))


def test_the_gguf_shape_must_be_the_checkpoints(tmp_path):
    config = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9}
    gguf = tiny_llama_gguf(tmp_path / "m.gguf", config)
    assert llamacpp.gguf_shape(gguf) == {"architecture": "llama", "block_count": 30, "embedding_length": 576,
                                         "feed_forward_length": 1536, "attention.head_count": 9}
    spec = ModelSpec("ckpt", tmp_path, config, 49152, 8192)
    llamacpp.check_same_model(gguf, spec)  # the same shape: no error
    other = ModelSpec("ckpt", tmp_path, {**config, "num_hidden_layers": 8, "hidden_size": 512}, 32000, 2048)
    with pytest.raises(ValueError, match="num_hidden_layers 8 vs block_count 30, hidden_size 512 vs "
                                         "embedding_length 576"):
        llamacpp.check_same_model(gguf, other)
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        llamacpp.gguf_shape(tmp_path / "x.gguf")
    (tmp_path / "cut.gguf").write_bytes(gguf.read_bytes()[:60])
    with pytest.raises(ValueError, match="ends early"):
        llamacpp.gguf_shape(tmp_path / "cut.gguf")


def test_command_line_holds_every_sequence_whole():
    argv = llamacpp.batched_bench_argv(Path("/b/llama-batched-bench"), Path("/m.gguf"), 4, 16, 8, 2)
    assert argv[0] == "/b/llama-batched-bench"
    pairs = dict(zip(argv[1::2], argv[2::2]))
    assert pairs == {"-m": "/m.gguf", "-c": "96", "-b": "96", "-ub": "96", "-npp": "16", "-ntg": "8", "-npl": "4",
                     "-t": "2", "-tb": "2", "-fa": "on"}
    big = dict(zip(*[iter(llamacpp.batched_bench_argv(Path("b"), Path("m"), 64, 512, 128, 1)[1:])] * 2))
    assert (big["-c"], big["-b"], big["-ub"]) == (str(64 * 640), "2048", "512")


def test_runs_through_a_stand_in_binary(tmp_path, monkeypatch):
    folder = make_stand_in(tmp_path / "bin")
    binary = llamacpp.find_binary(folder)
    assert binary == (folder / llamacpp.BINARY).resolve() and llamacpp.find_binary(binary) == binary
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the bench sets passive whatever the caller has
    run = llamacpp.run_batched_bench(binary, tmp_path / "m.gguf", 4, 16, 8, 2, timeout_s=60)
    assert run.threads == 2 and run.row.s_tok_s == 80.0 and run.row.t_s == pytest.approx(96 / 80, abs=1e-3)
    assert run.settings == {"n_kv_max": 96, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "n_threads": 2}
    [call] = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    assert call["omp"] == "passive" and call["argv"] == run.argv[1:]
    assert run.to_dict()["s_tok_s"] == 80.0 and run.to_dict()["argv"] == run.argv
    monkeypatch.setenv("STAND_IN_SMALL_CONTEXT", "1")
    with pytest.raises(RuntimeError, match="printed no row for PP 16, TG 8, B 4"):
        llamacpp.run_batched_bench(binary, tmp_path / "m.gguf", 4, 16, 8, 1, timeout_s=60)
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    with pytest.raises(RuntimeError, match="exited with 1; last output:\nerror: failed to load model"):
        llamacpp.run_batched_bench(binary, tmp_path / "m.gguf", 4, 16, 8, 1, timeout_s=60)
    with pytest.raises(FileNotFoundError, match="no llama-batched-bench at"):
        llamacpp.find_binary(tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / llamacpp.BINARY).write_text("not executable")
    with pytest.raises(FileNotFoundError, match="is not executable"):
        llamacpp.find_binary(plain)


def test_thread_counts_default_to_one_and_every_core():
    args = argparse.Namespace(llamacpp_threads=None)
    cores = len(os.sched_getaffinity(0))
    assert llamacpp.thread_counts(args) == sorted({1, cores})
    assert llamacpp.thread_counts(argparse.Namespace(llamacpp_threads=[4, 1])) == [4, 1]
