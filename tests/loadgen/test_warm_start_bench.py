"""The warm start's bench (mqinfer.loadgen.warm_start_bench) runs end to end on the tiny model."""

from __future__ import annotations

import json
import sys

import pytest

from mqinfer.loadgen import warm_start_bench

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the warm start is Linux-only")


def test_one_round_measures_cold_and_warm_workers(tmp_path, capsys):
    out = tmp_path / "rounds.json"
    assert warm_start_bench.main(["--workers", "1", "--rounds", "1", "--json", str(out)]) == 0
    cold, warm = json.loads(out.read_text())
    assert (cold["mode"], warm["mode"]) == ("cold", "warm")
    for result in (cold, warm):
        assert len(result["ready_s"]) == 1 and result["ready_s"][0] > 0 and result["one_more_ready_s"] > 0
        assert len(result["worker_pss_mib"]) == 2 and all(m > 0 for m in result["worker_pss_mib"])
    assert cold["template_pss_mib"] == 0 and warm["template_pss_mib"] > 0
    assert "round 1 warm: ready after" in capsys.readouterr().out
