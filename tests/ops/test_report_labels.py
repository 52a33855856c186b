"""Cost rows carry the request's labels (metadata, model_variant), reports group by them and by
length bands, and every grouping adds up: groups + overhead (+ duplicate) = every row's total.

The rows come from a real `mqinfer run` of the built-in tiny model (one run for the module)."""

from __future__ import annotations

import sys

import pytest

from mqinfer.ops.compact import compact
from mqinfer.ops.report import cost_report
from mqinfer.ops.report_keys import band_labels, checked_by
from mqinfer.ops.report_render import render
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.rows import COST_SCHEMA, CostRow
from tests import zygote
from tests.helpers import clean_env, rows, write_jsonl

LINES = ("retail", "travel", "health")
PRICE = 36.0


def _items() -> list[dict]:
    items = []
    for i in range(30):
        # Prompts of 4 to 200 tokens and outputs of 8 or 40: two bands of each.
        prompt = [5 + (i + k) % 200 for k in range(4 if i % 3 else 140 + i)]
        meta = {"business_line": LINES[i % 3], "ticket": f"T-{i}"}
        if i % 5 == 4:
            meta = {"ticket": f"T-{i}"}  # no business_line: its own "(none)" group
        items.append({"id": f"r{i}", "prompt_token_ids": prompt, "max_tokens": 40 if i % 2 else 8,
                      "temperature": 0, "ignore_eos": True, "tenant": "acme" if i % 2 else "beta",
                      "metadata": meta})
    # Labels past the limits: an error row that names the field, and a zero cost row.
    items.append({"id": "too-many", "prompt": "x", "metadata": {f"k{n}": "v" for n in range(17)}})
    items.append({"id": "too-long", "prompt": "x", "metadata": {"k": "v" * 513}})
    return items


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labels")
    src = write_jsonl(tmp / "in.jsonl", _items())
    env = clean_env("OMP_NUM_THREADS")
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(tmp / "out"),
                       "--workers", "1", "--price-per-device-hour", str(PRICE)],
                      env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compact(tmp / "out")
    return tmp / "out"


def test_cost_rows_carry_the_requests_metadata_and_the_model_variant(out):
    results = {r["id"]: r for r in rows(out / "results")}
    costs = rows(out / "costs")
    requests = [c for c in costs if c["kind"] == "request"]
    assert {c["id"] for c in requests} == set(results)
    for c in requests:
        assert dict(c["metadata"]) == dict(results[c["id"]]["metadata"])
    assert dict(next(c for c in requests if c["id"] == "r0")["metadata"]) == {"business_line": "retail",
                                                                              "ticket": "T-0"}
    # Every row a worker wrote says how it ran the model: the tiny model in float32, no quantization.
    ran = [c for c in costs if c["worker"] not in ("run", "submit")]
    assert ran and {c["model_variant"] for c in ran} == {
        "dtype=float32,quantization=none,kv_cache_dtype=float32,tp=1,pp=1"}
    assert {c["kind"] for c in ran} >= {"request", "startup"}


def test_metadata_past_the_limits_is_an_error_row_naming_the_field(out):
    results = {r["id"]: r for r in rows(out / "results")}
    for rid in ("too-many", "too-long"):
        row = results[rid]
        assert row["finish_reason"] == "error" and row["error_code"] == "invalid_request"
        assert "$.metadata" in row["error"], row["error"]
    assert "length <= 16" in results["too-many"]["error"]
    assert "length <= 512" in results["too-long"]["error"]
    # Nothing else was lost: every request has its row.
    assert len(results) == len(_items())


GROUPINGS = [["tenant"], ["metadata.business_line"], ["metadata.ticket"], ["model_variant"], ["prompt_band"],
             ["output_band"], ["metadata.business_line", "tenant"], ["prompt_band", "output_band", "model"],
             ["metadata.business_line", "job_id", "worker", "request_type"], ["metadata.absent"]]


@pytest.mark.parametrize("basis", ["usage", "allocation"])
@pytest.mark.parametrize("by", GROUPINGS, ids=lambda by: "+".join(by))
def test_every_grouping_adds_up_to_every_rows_total(out, by, basis):
    report = cost_report(out, by=by, basis=basis)
    t = report.totals
    every_row = sum(c["cost_usd"] for c in rows(out / "costs"))
    assert t.cost_usd == pytest.approx(every_row, rel=1e-9)
    assert t.overhead.cost_usd > 0 and t.billed.cost_usd > 0
    groups = sum(g.total_usd for g in report.groups)
    if basis == "usage":
        assert groups + t.overhead.cost_usd + t.duplicate.cost_usd == pytest.approx(t.cost_usd, rel=1e-9)
    else:
        assert t.allocated.cost_usd > 0
        assert groups + t.unallocated.cost_usd + t.duplicate.cost_usd == pytest.approx(t.cost_usd, rel=1e-9)
    assert sum(g.device_s for g in report.groups) == pytest.approx(t.billed.device_s, rel=1e-9)
    assert sum(g.requests for g in report.groups) == t.requests == len(_items())


def test_metadata_groups_are_the_labels_values(out):
    report = cost_report(out, by=["metadata.business_line"])
    groups = {g.key["metadata.business_line"]: g for g in report.groups}
    # r4, r9, ... have no business_line, nor have the two rejected requests.
    assert set(groups) == {*LINES, None}
    assert groups[None].requests == 6 + 2
    assert groups["retail"].requests == sum(1 for i in range(30) if i % 3 == 0 and i % 5 != 4)
    by_line: dict = {}
    for c in rows(out / "costs"):
        if c["kind"] == "request":
            line = dict(c["metadata"] or {}).get("business_line")
            by_line[line] = by_line.get(line, 0.0) + c["cost_usd"]
    for line, usd in by_line.items():
        assert groups[line].cost_usd == pytest.approx(usd, rel=1e-12)
    table = render(report, "table")
    assert "metadata.business_line" in table.splitlines()[0] and "(none)" in table


def test_length_bands_split_long_from_short(out):
    prompts = {g.key["prompt_band"]: g for g in cost_report(out, by="prompt_band").groups}
    assert set(prompts) == {"0-127", "128-511"}
    assert prompts["128-511"].requests == 10 and prompts["0-127"].requests == 22
    outputs = {g.key["output_band"]: g for g in cost_report(out, by="output_band").groups}
    assert set(outputs) == {"0-31", "32-127"}
    # The long outputs cost more per request than the short ones.
    long_, short = outputs["32-127"], outputs["0-31"]
    assert long_.cost_usd / long_.requests > short.cost_usd / short.requests


def test_band_labels_cover_every_count():
    assert band_labels((128, 512)) == ["0-127", "128-511", "512+"]
    for key in ("prompt_band", "output_band", "metadata.x", "model_variant"):
        assert checked_by(key) == [key]
    for bad in (["metadata."], ["tenant", "tenant"], [], ["cost"]):
        with pytest.raises(ValueError, match="metadata.KEY"):
            checked_by(bad)


def test_rows_written_before_the_columns_existed_group_as_none(tmp_path):
    old = COST_SCHEMA.remove(COST_SCHEMA.get_field_index("model_variant")).remove(
        COST_SCHEMA.get_field_index("metadata"))
    DatasetWriter(tmp_path / "costs", old, "w1").write([
        CostRow(kind="request", id="a", job_id="j", tenant="t", model="m", prompt_tokens=600, output_tokens=3,
                device_s=2.0, cost_usd=0.02, price_per_device_hour=36.0, worker="w1", finished_at=1.7e9, index=0),
        CostRow(kind="idle", device_s=1.0, cost_usd=0.01, price_per_device_hour=36.0, worker="w1",
                finished_at=1.7e9),
    ])
    for by in GROUPINGS[:6]:
        report = cost_report(tmp_path, by=by, basis="allocation")
        (group,) = report.groups
        assert group.total_usd == pytest.approx(0.03)
    (group,) = cost_report(tmp_path, by=["metadata.business_line", "model_variant", "prompt_band"]).groups
    assert group.key == {"metadata.business_line": None, "model_variant": None, "prompt_band": "512-2047"}
