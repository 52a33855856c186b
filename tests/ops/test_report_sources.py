"""Reports over the fleet: several output folders, and an S3-compatible object store (moto's server,
started by the test), give the report of the same rows in one folder. The rows are a real
two-worker `mqinfer run` of the built-in tiny model."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from mqinfer.ops.report import cost_report
from mqinfer.ops.report_render import render
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.rows import COST_SCHEMA
from tests import zygote
from tests.helpers import clean_env, mqinfer_cmd, write_jsonl

BY = ["metadata.team", "worker", "prompt_band"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(one folder with every row, folder A, folder B): A and B split the part files by worker."""
    tmp = tmp_path_factory.mktemp("fleet")
    items = [{"id": f"r{i}", "prompt_token_ids": [5 + (i * 7 + k) % 200 for k in range(6 + 20 * (i % 4))],
              "max_tokens": 6 + i % 9, "temperature": 0, "ignore_eos": True,
              "metadata": {"team": ("search", "ads", "maps")[i % 3]}} for i in range(24)]
    src = write_jsonl(tmp / "in.jsonl", items)
    env = clean_env("OMP_NUM_THREADS")
    whole = tmp / "whole"
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(whole), "--workers", "2",
                       "--num-threads", "1", "--price-per-device-hour", "36"],
                      env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The rows of the first worker go to A, every other row to B, each in its date partition.
    table = pq.read_table(whole / "costs", schema=COST_SCHEMA, partitioning="hive").select(COST_SCHEMA.names)
    first = sorted(set(table["worker"].to_pylist()))[0]
    a, b = tmp / "a", tmp / "b"
    for dest, mask in ((a, pc.equal(table["worker"], first)), (b, pc.not_equal(table["worker"], first))):
        part = table.filter(mask)
        days = pc.strftime(part["finished_at"], format="date=%Y-%m-%d")
        for day in set(days.to_pylist()):
            DatasetWriter(dest / "costs", COST_SCHEMA, dest.name).write_table(day, part.filter(pc.equal(days, day)))
    assert list(a.rglob("part-*.parquet")) and list(b.rglob("part-*.parquet"))
    return whole, a, b


def _same(one, other):
    """Two reports over the same rows: equal keys, counts and tokens, sums equal to 1e-12."""
    assert [g.key for g in one.groups] == [g.key for g in other.groups]
    for g, h in zip(one.groups, other.groups):
        assert (g.requests, g.prompt_tokens, g.output_tokens) == (h.requests, h.prompt_tokens, h.output_tokens)
        assert g.cost_usd == pytest.approx(h.cost_usd, rel=1e-12)
        assert g.total_usd == pytest.approx(h.total_usd, rel=1e-12)
    t, u = one.totals, other.totals
    assert t.cost_usd == pytest.approx(u.cost_usd, rel=1e-12) and t.requests == u.requests
    assert t.overhead.cost_usd == pytest.approx(u.overhead.cost_usd, rel=1e-12)
    assert t.device_s_by_kind == pytest.approx(u.device_s_by_kind, rel=1e-12)


@pytest.mark.parametrize("basis", ["usage", "allocation"])
def test_two_folders_report_as_one(fleet, basis):
    whole, a, b = fleet
    one = cost_report(whole, by=BY, basis=basis)
    _same(cost_report([a, b], by=BY, basis=basis), one)
    # Each folder alone has part of it.
    assert cost_report(a, by=BY).totals.cost_usd < one.totals.cost_usd


def test_the_command_takes_several_folders(fleet):
    whole, a, b = fleet
    both = zygote.run(mqinfer_cmd("report", "costs", str(a), str(b), "--by", ",".join(BY), "--format", "json"),
                      capture_output=True, text=True, timeout=120)
    assert both.returncode == 0, both.stderr
    assert json.loads(both.stdout)["totals"]["requests"] == 24
    missing = zygote.run(mqinfer_cmd("report", "costs", str(a), str(a.parent / "nope")),
                         capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such output folder" in missing.stderr


def test_compact_takes_several_folders_and_refuses_object_stores(fleet, tmp_path):
    whole, a, b = fleet
    copies = []
    for name in ("x", "y"):
        shutil.copytree(whole, tmp_path / name)
        copies.append(str(tmp_path / name))
    done = zygote.run(mqinfer_cmd("compact", *copies), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(f"{c}: results: 24 rows -> 24" in done.stdout for c in copies)
    remote = zygote.run(mqinfer_cmd("compact", "s3://bucket/out"), capture_output=True, text=True, timeout=120)
    assert remote.returncode != 0 and "needs a local folder" in remote.stderr


def test_an_s3_store_reports_as_the_folder(fleet, s3):
    from pyarrow import fs

    whole, a, b = fleet
    endpoint, filesystem = s3
    fs.copy_files(str(whole / "costs"), "fleet/run1/costs", destination_filesystem=filesystem)
    # A temporary file a writer left behind is not read.
    with filesystem.open_output_stream("fleet/run1/costs/date=2020-01-01/.tmp-abc.parquet") as f:
        f.write(b"not parquet")
    uri = f"s3://fleet/run1?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    for basis in ("usage", "allocation"):
        _same(cost_report(uri, by=BY, basis=basis), cost_report(whole, by=BY, basis=basis))
    # A folder and a store together: the union of their rows.
    fs.copy_files(str(b / "costs"), "fleet/b/costs", destination_filesystem=filesystem)
    b_uri = f"s3://fleet/b?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    _same(cost_report([a, b_uri], by=BY), cost_report(whole, by=BY))
    # The command line reads it too.
    proc = zygote.run(mqinfer_cmd("report", "costs", uri, "--format", "csv"), capture_output=True, text=True,
                      timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert render(cost_report(whole), "csv").splitlines()[-1].split(",")[0] == "total"
    assert proc.stdout.splitlines()[-1].split(",")[0] == "total"
    with pytest.raises(FileNotFoundError, match="no costs/ dataset"):
        cost_report(f"s3://fleet/nothing?endpoint_override={endpoint}&scheme=http&region=us-east-1")


def test_a_path_that_is_no_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such output folder"):
        cost_report([tmp_path / "nope"])
    with pytest.raises(ValueError, match="no output folder"):
        cost_report([])
    Path(tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no costs/ dataset"):
        cost_report([tmp_path / "empty"])
