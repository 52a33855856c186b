"""The structured-output workload (60 JSON Schemas) and bench, on the tiny model."""

from __future__ import annotations

import json

import jsonschema

from mqinfer.loadgen import structured_bench
from mqinfer.loadgen.structured_workload import HAND_WRITTEN, json_schemas, structured_requests
from mqinfer.schemas.request import request_from_obj


def test_the_schemas_are_valid_varied_and_the_same_every_time():
    schemas = json_schemas(60)
    assert schemas == json_schemas(60) and len({name for name, _ in schemas}) == 60
    assert schemas[: len(HAND_WRITTEN)] == HAND_WRITTEN
    text = json.dumps(schemas)
    for keyword in ('"enum"', '"minimum"', '"maxItems"', '"pattern"', '"null"', '"anyOf"', '"boolean"', '"number"'):
        assert keyword in text, keyword
    optional = 0
    for _, schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
        optional += set(schema["required"]) != set(schema["properties"])
    assert optional >= 10
    nested = [s for _, s in schemas if any(p.get("type") == "object" or "items" in p for p in s["properties"].values())]
    assert len(nested) >= 15


def test_requests_carry_the_schema_as_response_format():
    requests = structured_requests(json_schemas(3), per_schema=2, temperature=0.5, seed=10)
    assert [r["id"] for r in requests] == ["sentiment-0", "topic-0", "person-0", "sentiment-1", "topic-1", "person-1"]
    assert [r["seed"] for r in requests] == list(range(10, 16))
    req = request_from_obj(requests[2])
    assert req.response_format.json_schema.schema == HAND_WRITTEN[2][1]
    assert "person" in req.messages[1].content and '"maxLength"' in req.messages[1].content


def test_throughput_and_validity_runs_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert structured_bench.main(["--num-requests", "8", "--repeat", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_requests"] == 8 and report["output_tokens"] > 8
    assert report["constrained_tokens_per_s"] > 0 and report["unconstrained_tokens_per_s"] > 0 and report["ratio"] > 0
    assert report["mask_steps"] > 0 and report["mask_fill_us_per_mask"] > 0
    assert "constrained" in capsys.readouterr().out

    out = tmp_path / "validity.json"
    assert structured_bench.main(["--validity", "--num-schemas", "4", "--max-tokens", "200", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    for label in ("greedy", "seeded"):
        run = runs[label]
        assert run["rows"] == 4 and run["stop_valid"] == run["stop"] and run["schema_valid_disagrees"] == 0
    assert runs["greedy_unconstrained"]["rows"] == 4
