"""`report costs`, `jobs` and `compact` read MQINFER_* and --config like the other commands:
command line > environment > config file > default, the off forms included, unknown keys refused."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest

from mqinfer import cli, jobs_cli
from mqinfer.schemas import keys
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, CostRow, ResultRow
from tests.helpers import write_jsonl

T = 1_700_000_000.0


@pytest.fixture(autouse=True)
def _no_mqinfer_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("MQINFER_")]:
        monkeypatch.delenv(name)
    # main() would point the root logger at this test's stderr for the rest of the session.
    monkeypatch.setattr(cli, "setup_logging", lambda level, fmt: None)


def mqinfer(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def toml(tmp_path, text: str):
    path = tmp_path / "mq.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def costs_dir(tmp_path):
    """Three billed requests: acme on tiny (2 s and 1 s), beta on big (4 s)."""
    out = tmp_path / "out"
    rows = [("a", "acme", "tiny", 2.0), ("b", "acme", "tiny", 1.0), ("c", "beta", "big", 4.0)]
    DatasetWriter(out / "costs", COST_SCHEMA, "w1").write([
        CostRow(kind="request", job_id="j", id=rid, tenant=tenant, model=model, request_type="chat",
                prompt_tokens=10, output_tokens=5, device_s=s, cost_usd=s / 3600, price_per_device_hour=1.0,
                worker="w1", finished_at=T + i) for i, (rid, tenant, model, s) in enumerate(rows)])
    DatasetWriter(out / "results", RESULT_SCHEMA, "w1").write([
        ResultRow(job_id="j", id=rid, tenant=tenant, model=model, finish_reason="stop", prompt_tokens=10,
                  output_tokens=5, output_token_ids=[1] * 5, text="ok", finished_at=T + i, worker="w1")
        for i, (rid, tenant, model, _) in enumerate(rows)])
    return out


def test_report_costs_reads_env_and_config(monkeypatch, tmp_path, capsys, costs_dir):
    monkeypatch.setenv("MQINFER_FORMAT", "json")
    code, out, err = mqinfer(capsys, "report", "costs", str(costs_dir))
    assert code == 0, err
    report = json.loads(out)
    assert report["by"] == ["tenant"] and len(report["groups"]) == 2

    # The command line beats the environment.
    code, out, _ = mqinfer(capsys, "report", "costs", str(costs_dir), "--format", "csv")
    assert code == 0 and list(csv.DictReader(io.StringIO(out)))[0]["row"] == "group"

    # A [report] table overrides the top level; the environment still beats both.
    config = toml(tmp_path, 'by = "tenant"\ntop = 5\n[report]\nby = "model"\ntop = 1\nformat = "csv"\n')
    code, out, err = mqinfer(capsys, "report", "costs", str(costs_dir), "--config", config)
    assert code == 0, err
    report = json.loads(out)
    assert report["by"] == ["model"]
    assert {g["key"]["model"]: g["device_s"] for g in report["groups"]} == {"tiny": 3.0, "big": 4.0}
    assert [r["id"] for r in report["top_requests"]] == ["c"]

    monkeypatch.delenv("MQINFER_FORMAT")
    monkeypatch.setenv("MQINFER_CONFIG", config)
    monkeypatch.setenv("MQINFER_TOP", "2")
    code, out, _ = mqinfer(capsys, "report", "costs", str(costs_dir))
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and sorted(float(r["device_s"]) for r in rows if r["row"] == "group") == [3.0, 4.0]

    monkeypatch.setenv("MQINFER_TOP", "lots")
    code, _, err = mqinfer(capsys, "report", "costs", str(costs_dir))
    assert code == 2 and "--top (from environment MQINFER_TOP): invalid literal" in err


def test_report_costs_refuses_unknown_config_keys(tmp_path, capsys, costs_dir):
    unknown = toml(tmp_path, "[report]\ngroupby = 'x'\n")
    code, _, err = mqinfer(capsys, "report", "costs", str(costs_dir), "--config", unknown)
    assert code == 2 and "report.groupby is not a flag of any command" in err
    code, _, err = mqinfer(capsys, "report", "costs", str(costs_dir), "--config", toml(tmp_path, "format = 'yaml'\n"))
    assert code == 2 and "--format (from config file key format): 'yaml' is not one of table, csv, json" in err


def test_compact_reads_env_and_config(monkeypatch, tmp_path, capsys, costs_dir):
    bad = toml(tmp_path, '[compact]\nlog-level = "loud"\n')
    code, _, err = mqinfer(capsys, "compact", str(costs_dir), "--config", bad)
    assert code == 2 and "--log-level (from config file key log_level): 'loud' is not one of" in err
    monkeypatch.setenv("MQINFER_LOG_LEVEL", "loud")
    code, _, err = mqinfer(capsys, "compact", str(costs_dir))
    assert code == 2 and "--log-level (from environment MQINFER_LOG_LEVEL)" in err
    # The command line wins over both, and the compaction runs.
    code, out, err = mqinfer(capsys, "compact", str(costs_dir), "--config", bad, "--log-level", "warning")
    assert code == 0, err
    assert out.startswith("results: 3 rows -> 3 (0 duplicates removed)")
    code, _, err = mqinfer(capsys, "compact", str(costs_dir), "--config", toml(tmp_path, "[compact]\ndry_run = 1\n"),
                           "--log-level", "warning")
    assert code == 2 and "compact.dry_run is not a flag of any command" in err


def test_jobs_submit_and_list_read_env_and_config(monkeypatch, tmp_path, capsys, redis_url, redis_client):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": [1, 2]} for i in range(3)])
    monkeypatch.setenv("MQINFER_REDIS", redis_url)
    monkeypatch.setenv("MQINFER_CHUNK_SIZE", "3")
    config = toml(tmp_path, f'out = "{tmp_path / "job1"}"\nmax-in-flight = 99\n[jobs]\njson = true\n'
                            'max_in_flight = 7\n')
    code, out, err = mqinfer(capsys, "jobs", "submit", str(src), "--config", config)
    assert code == 0, err
    job_id = json.loads(out)["job_id"]
    job = redis_client.hgetall(keys.job_key(job_id))
    assert (job[b"max_in_flight"], job[b"chunk_size"]) == (b"7", b"3")

    # --no-json on the command line beats json = true in the file: the plain id.
    code, out, err = mqinfer(capsys, "jobs", "submit", str(src), "--config", config, "--out", str(tmp_path / "job2"),
                             "--no-json")
    assert code == 0, err
    second = out.strip()
    assert second != job_id and not second.startswith("{")
    assert redis_client.exists(keys.job_key(second)) == 1

    monkeypatch.setenv("MQINFER_JSON", "1")
    code, out, _ = mqinfer(capsys, "jobs", "list")
    assert code == 0 and {j["id"] for j in json.loads(out)} == {job_id, second}
    code, out, _ = mqinfer(capsys, "jobs", "list", "--config", toml(tmp_path, "[jobs]\nlimit = 1\n"))
    assert code == 0 and [j["id"] for j in json.loads(out)] == [second]  # newest first
    code, out, _ = mqinfer(capsys, "jobs", "list", "--no-json")
    assert code == 0 and out.splitlines()[0].startswith("ID") and len(out.splitlines()) == 3

    monkeypatch.setenv("MQINFER_INTERVAL", "0")
    code, _, err = mqinfer(capsys, "jobs", "status", job_id)
    assert code == 2 and "--interval must be > 0, got 0.0" in err
    code, _, err = mqinfer(capsys, "jobs", "status", job_id, "--config", toml(tmp_path, "[jobs]\nwatchh = true\n"))
    assert code == 2 and "jobs.watchh is not a flag of any command" in err


def test_jobs_worker_flags_from_env_and_config(monkeypatch, tmp_path):
    parser = cli.build_parser()

    def opts(*argv: str) -> dict:
        args = parser.parse_args(["jobs", "worker", *argv])
        args._config_known = cli.config_keys(parser)
        return jobs_cli._options(args)

    monkeypatch.setenv("MQINFER_REDIS", "redis://unused")
    config = toml(tmp_path, "[jobs]\nname = 'from-file'\nburst = true\nsweep-interval-s = 0.5\n")
    assert (opts()["name"], opts()["burst"]) == (None, False)
    got = opts("--config", config)
    assert (got["name"], got["burst"], got["sweep_interval_s"]) == ("from-file", True, 0.5)
    monkeypatch.setenv("MQINFER_NAME", "from-env")
    monkeypatch.setenv("MQINFER_NO_BURST", "1")
    got = opts("--config", config)
    assert (got["name"], got["burst"]) == ("from-env", False)
    assert opts("--config", config, "--burst", "--name", "cli")["burst"] is True


def test_jobs_defaults_match_the_job_functions():
    """The jobs flags' defaults are the ones submit_job and run_worker use when called directly."""
    import inspect

    from mqinfer.ops.jobs import run_worker, submit_job

    defaults = {**{k: p.default for k, p in inspect.signature(submit_job).parameters.items()},
                **{k: p.default for k, p in inspect.signature(run_worker).parameters.items()}}
    by_name = {o.name: o.default for o in [*jobs_cli.SUBMIT_OPTIONS, *jobs_cli.WORKER_OPTIONS]}
    for flag, parameter in [("max_in_flight", "max_in_flight"), ("chunk_size", "chunk_size"), ("queue", "queue_name"),
                            ("lease_s", "lease_s"), ("stream", "stream"), ("shards", "shards"),
                            ("order", "order"), ("route", "route"), ("sweep_interval_s", "sweep_interval_s"),
                            ("burst", "burst"), ("name", "name")]:
        assert by_name[flag] == defaults[parameter], flag
