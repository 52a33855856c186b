"""The files under ops/: alert rules (promtool when installed, else parsed), the Grafana dashboard,
scrape configs and deployment examples. Every metric they name is one the worker exports, and
every worker flag they pass is a real flag."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mqinfer.cli import build_parser
from mqinfer.ops.budgets import Budgets, BudgetGuard, load_budgets
from mqinfer.ops.metrics import WorkerMetrics
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.workers.queue.costs import Meter, WorkModel
from mqinfer.workers.tenant_limits import TenantLimit

OPS = Path(__file__).resolve().parents[2] / "ops"
RULES = OPS / "alerts" / "mqinfer-rules.yml"
RULE_TESTS = OPS / "alerts" / "mqinfer-rules.test.yml"
DASHBOARD = OPS / "dashboards" / "mqinfer.json"
DEPLOY = OPS / "deploy"
PROMTOOL = shutil.which("promtool")
METRIC = re.compile(r"\bmqinfer_[a-z0-9_]+")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Metric family names of a worker with every collector attached (no Redis: those export
    their names without samples)."""
    m = WorkerMetrics()
    m.track_meter(Meter(WorkModel(1.0, 1.0, 1.0), start=0.0))
    m.track_engine(Scheduler(SchedulerConfig(num_kv_blocks=8)))
    m.watch_memory("cpu")
    m.watch_stream(None, "mqinfer:{requests}", "workers")
    m.watch_budgets(BudgetGuard(Budgets(tenants={"acme": 1.0}), None, "requests"))
    m.charge("acme", 1.0)
    m.track_rate_limits({"acme": TenantLimit(100.0, 2.0)}, lambda: {"acme": 1})
    text = generate_latest(m.registry).decode()
    # The text format shows a counter's creation time as a family of its own: not a metric.
    return {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in METRIC.findall(expr):
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def load_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_are_valid_and_cover_what_operators_watch(exported):
    rules = load_rules()
    names = {r["alert"] for r in rules}
    for wanted in ("MqinferKVCacheNearlyFull", "MqinferE2ELatencyP99High", "MqinferStreamLagGrowing",
                   "MqinferDeadLetters", "MqinferTenantOverBudget", "MqinferTenantCostBurnOverBudget"):
        assert wanted in names
    assert len(names) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        used = metric_names(rule["expr"])
        assert used <= exported, (rule["alert"], used - exported)
    kv = next(r for r in rules if r["alert"] == "MqinferKVCacheNearlyFull")
    assert "mqinfer_kv_cache_usage_ratio" in kv["expr"] and "0.9" in kv["expr"]
    assert "histogram_quantile(0.99" in next(r for r in rules if r["alert"] == "MqinferE2ELatencyP99High")["expr"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in check.stdout
    tests = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=60)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_rule_unit_tests_name_real_alerts():
    doc = yaml.safe_load(RULE_TESTS.read_text())
    alerts = {r["alert"] for r in load_rules()}
    tested = {t["alertname"] for case in doc["tests"] for t in case["alert_rule_test"]}
    assert tested <= alerts and len(tested) >= 5


def test_dashboard_is_grafana_json_over_exported_metrics(exported):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    used = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for target in p.get("targets", []):
            used |= metric_names(target["expr"])
            assert target["datasource"]["uid"] == "${datasource}"
    assert used <= exported, used - exported
    # Every metric the worker exports on its own (not the process collector's) is on a panel.
    own = {name for name in exported if not name.startswith("mqinfer_process_")}
    assert own - used == set()


def _promtool_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-kubernetes.yml"])
def test_scrape_configs(name):
    path = DEPLOY / name
    doc = yaml.safe_load(path.read_text())
    for rule_file in doc["rule_files"]:
        assert (path.parent / rule_file).resolve() == RULES
    jobs = doc["scrape_configs"]
    assert jobs and all(j["job_name"].startswith("mqinfer") for j in jobs)
    if PROMTOOL is None:
        return
    result = _promtool_config(path)
    out = result.stdout + result.stderr
    if "field kubernetes_sd_configs not found" in out:
        pytest.skip("this promtool build has no Kubernetes service discovery (a distribution build)")
    assert result.returncode == 0, out


def worker_args(argv: list[str]):
    """Parse a worker command line with the real parser (SystemExit on an unknown flag)."""
    start = argv.index("worker")
    return build_parser().parse_args(argv[start:])


def test_systemd_unit():
    path = DEPLOY / "mqinfer-worker@.service"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(path.read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) > 30  # > the drain timeout
    assert service["Restart"] == "on-failure"
    args = worker_args(shlex.split(service["ExecStart"]))
    assert args.metrics_port == "94%i" and args.metrics_host == "0.0.0.0"


def test_compose_file():
    path = DEPLOY / "compose.yaml"
    doc = yaml.safe_load(path.read_text())
    services = doc["services"]
    assert {"redis", "worker", "prometheus", "grafana"} <= set(services)
    worker = services["worker"]
    args = worker_args(worker["command"])
    assert args.metrics_host == "0.0.0.0" and args.metrics_port == "9400"
    assert "/readyz" in " ".join(worker["healthcheck"]["test"]) and "9400" in " ".join(worker["healthcheck"]["test"])
    assert worker["environment"]["MQINFER_REDIS"].startswith("redis://")
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":", 1)[0]
            assert (path.parent / source).exists(), (service, source)


def test_kubernetes_deployment_probes_the_metrics_port(tmp_path):
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["apiVersion"] == "apps/v1"
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = spec["containers"]
    args = worker_args(container["args"])
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert port["containerPort"] == int(args.metrics_port) and args.metrics_host == "0.0.0.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["terminationGracePeriodSeconds"] > 30
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    budgets = tmp_path / "budgets.toml"
    budgets.write_text(config_map["data"]["budgets.toml"])
    assert load_budgets(budgets).limit("search") == 2000.0
    assert args.budgets == "/etc/mqinfer/budgets.toml"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["budgets"] == "/etc/mqinfer"
    tomllib.loads(config_map["data"]["budgets.toml"])


def _keda_lanes_query() -> str:
    docs = list(yaml.safe_load_all((DEPLOY / "keda.yaml").read_text()))
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    return next(t for t in scaled["spec"]["triggers"] if t["name"] == "lanes")["metadata"]["query"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_the_keda_lanes_query_counts_the_fleet_backlog_once_whatever_the_workers(tmp_path):
    """The shipped query, evaluated by Prometheus's own engine over the series of three workers of
    one stream and two of another (a sharded fleet): each stream's backlog counts once."""
    a, b = "mqinfer:{requests}", "mqinfer:{requests:1}"
    series = [(a, "w1", 120), (a, "w2", 120), (a, "w3", 121), (b, "w4", 30), (b, "w5", 30)]
    test = {
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": f'mqinfer_stream_lag{{instance="{w}:9400", job="mqinfer", stream="{s}"}}',
                              "values": f"{v}x5"} for s, w, v in series],
            "promql_expr_test": [{"expr": _keda_lanes_query(), "eval_time": "3m",
                                  "exp_samples": [{"labels": "{}", "value": 121 + 30}]}],
        }],
    }
    path = tmp_path / "keda-query.test.yml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_keda_scaled_object_follows_the_worker_stream_and_scales_to_zero():
    jsonschema = pytest.importorskip("jsonschema")
    from mqinfer.schemas import keys

    docs = list(yaml.safe_load_all((DEPLOY / "keda.yaml").read_text()))
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    schema = json.loads((DEPLOY / "keda-scaledobject.schema.json").read_text())
    jsonschema.validate(scaled, schema)
    spec = scaled["spec"]
    deployment = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text())
                      if d["kind"] == "Deployment")
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
    triggers = {t["name"]: t["metadata"] for t in spec["triggers"]}
    streams = [t for t in spec["triggers"] if t["type"] == "redis-streams"]
    for meta in (t["metadata"] for t in streams):  # the stream and group the workers read
        assert meta["stream"] == keys.request_stream("requests") and meta["consumerGroup"] == keys.GROUP
    assert "lagCount" in triggers["lag"] and "pendingEntriesCount" in triggers["pending"]
    # The lanes' backlog, which the redis-streams triggers cannot see, through the workers' metric
    # that counts every lane.
    assert "mqinfer_stream_lag" in triggers["lanes"]["query"]
    auth = {d["metadata"]["name"] for d in docs if d["kind"] == "TriggerAuthentication"}
    assert {t["authenticationRef"]["name"] for t in streams} <= auth
    # The schema catches the usual mistakes: a number where KEDA wants a string, two targets in
    # one trigger.
    for broken in ({**triggers["lag"], "lagCount": 64}, {**triggers["lag"], "pendingEntriesCount": "8"}):
        bad = json.loads(json.dumps(scaled))
        bad["spec"]["triggers"][0]["metadata"] = broken
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
