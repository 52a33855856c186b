"""The dense-layer microbenchmark's bfloat16 mode (w8a8 on bfloat16 rows against bfloat16
torch.mm) and its shape option."""

from __future__ import annotations

import pytest
import torch

from mqinfer.kernels import linear_int8 as q8
from mqinfer.loadgen import bench_dense


@pytest.mark.skipif(not q8.native_takes_bf16(), reason="the w8a8 kernel takes bfloat16 rows only with AVX-512 VNNI")
def test_the_bfloat16_mode_times_both_kernels_at_the_given_shapes(capsys):
    threads = torch.get_num_threads()
    try:
        assert bench_dense.main(["--dtype", "bfloat16", "--shapes", "64x300", "32X48", "--rows", "3",
                                 "--repeats", "1", "--weights-mb", "0"]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark runs on one thread
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "|" in line and "rows" not in line]
    # One row per shape: K x N, rows, then both rates and their ratio.
    assert [(line[0], line[2], line[3]) for line in lines] == [("64", "300", "3"), ("32", "48", "3")]
    for line in lines:
        bf16, w8a8, ratio = float(line[5]), float(line[6]), float(line[8].rstrip("x"))
        # The rates are printed to within 0.05 (three significant digits, one decimal from 100 up),
        # the ratio from the unrounded rates.
        assert bf16 > 0 and w8a8 > 0 and abs(ratio - w8a8 / bf16) <= 0.05 * (1 + ratio) / bf16 + 0.01


def test_a_bad_shape_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_dense.main(["--shapes", "512by64"])
    assert exit_info.value.code == 2 and "expected KxN" in capsys.readouterr().err
