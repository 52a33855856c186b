"""`python -m mqinfer.loadgen.sampling_bench`: both sampling paths timed on the same rows, and the
same tokens from both."""

from __future__ import annotations

import re

from mqinfer.loadgen import sampling_bench


def test_it_times_both_paths_and_checks_they_agree(capsys):
    assert sampling_bench.main(["--rows", "8", "--vocab", "300", "--top-p", "0.9", "--repeats", "2"]) == 0
    line = capsys.readouterr().out
    assert re.search(r"native [\d.]+ ms, PyTorch [\d.]+ ms \([\d.]+x\); same tokens: True", line), line


def test_bad_values_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        sampling_bench.main(["--rows", "0"])
    assert exc.value.code == 2 and "--rows" in capsys.readouterr().err
