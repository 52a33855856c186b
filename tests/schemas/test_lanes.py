"""The lane key scheme: which lane a request goes to, names that stay inside the scheme, and the
bounded registry (a real server)."""

from __future__ import annotations

import pytest
import redis

from mqinfer.client import Client, Producer
from mqinfer.schemas import keys
from mqinfer.schemas import lanes
from mqinfer.schemas.stream import decode_entry


def test_lane_of_a_request_by_mode():
    assert lanes.lane_name("none", "alice", "j1") is None
    # The default tenant, and requests without a job, stay on the plain stream.
    assert lanes.lane_name("tenant", "default", "j1") is None
    assert lanes.lane_name("job", "alice", None) is None
    assert lanes.lane_name("tenant,job", "default", None) is None
    alice = lanes.lane_name("tenant", "alice", "j1")
    assert alice.startswith("t-alice-") and alice == lanes.lane_name("tenant", "alice", "j2")
    assert lanes.lane_name("job", "alice", "j1") != lanes.lane_name("job", "bob", "j2")
    assert lanes.lane_name("job", "alice", "j1") == lanes.lane_name("job", "bob", "j1")
    both = lanes.lane_name("tenant,job", "alice", "j1")
    assert both != lanes.lane_name("tenant,job", "alice", "j2") != lanes.lane_name("tenant,job", "bob", "j2")
    assert lanes.parse_lanes("job,tenant") == "tenant,job"
    for bad in ("", "tenants", "tenant,none,x", "all"):
        with pytest.raises(ValueError, match="--lanes must be one of"):
            lanes.parse_lanes(bad)
    with pytest.raises(ValueError, match="--max-lanes"):
        lanes.check_max_lanes(0)


@pytest.mark.parametrize("tenant", ["}{requests}", "a b\nc", "x" * 120, "ümlaut", "../../etc", "*", "a:lane:b"])
def test_hostile_tenant_names_stay_inside_the_scheme(tenant):
    lane = lanes.lane_name("tenant", tenant, None)
    assert lanes.valid_lane(lane) and len(lane) <= 64
    key = keys.request_stream(lanes.lane_stream("requests", lane))
    # One hash tag, the lane's: the key is the lane's own, in the scheme's namespace.
    assert key.startswith("mqinfer:{requests:lane:t-") and key.count("{") == 1 and key.count("}") == 1
    # Two names that slug alike are still two lanes.
    assert lane != lanes.lane_name("tenant", tenant + "_", None)


def test_the_registry_is_bounded_and_past_it_tenants_share_hashed_lanes(redis_client, redis_url):
    producer = Producer(redis_url, max_lanes=8)  # 7 dedicated lanes, 1 shared
    for i in range(20):
        producer.submit({"id": f"r{i}", "prompt": "x", "tenant": f"tenant{i}"})
    registered = lanes.registered(redis_client, "requests")
    assert len(registered) == 8
    assert sum(1 for n in registered if n.startswith("shared-")) == 1
    # Every request is in exactly one lane's stream, none lost, none on the plain stream.
    found = {}
    for name in registered:
        for _, fields in redis_client.xrange(keys.request_stream(lanes.lane_stream("requests", name))):
            req = decode_entry(fields)
            found[req.id] = name
    assert sorted(found) == sorted(f"r{i}" for i in range(20))
    assert sum(1 for n in found.values() if n.startswith("shared-")) == 13
    # A new lane's notice went to the plain stream, once per lane.
    notices = [f for _, f in redis_client.xrange(keys.request_stream("requests")) if b"lane" in f]
    assert len(notices) == 8
    # A producer with a larger limit registers a dedicated lane while the registry has room under it
    # (10 lanes, one of them kept for sharing: the 9th registered is dedicated).
    Producer(redis_url, max_lanes=10).submit({"id": "late", "prompt": "x", "tenant": "latecomer"})
    assert lanes.lane_name("tenant", "latecomer", None) in lanes.registered(redis_client, "requests")
    assert len(lanes.registered(redis_client, "requests")) == 9


def test_client_backpressure_is_per_lane(redis_url, redis_client):
    with Client(redis_url, max_backlog=3, backpressure="raise") as client:
        client.submit_many([{"id": f"b{i}", "prompt": "x", "tenant": "bulk"} for i in range(3)], reply=False)
        # The bulk lane is full; another tenant still gets in.
        client.submit({"id": "i0", "prompt": "x", "tenant": "interactive"}, reply=False)
        assert client.backlog(tenant="bulk") == 3 and client.backlog(tenant="interactive") == 1
        from mqinfer.client import BackpressureError

        with pytest.raises(BackpressureError, match="t-bulk-"):
            client.submit({"id": "b3", "prompt": "x", "tenant": "bulk"}, reply=False)


def test_remove_lane_only_when_empty(redis_client, redis_url):
    producer = Producer(redis_url)
    producer.submit({"id": "a", "prompt": "x", "tenant": "alice"})
    lane = lanes.lane_name("tenant", "alice", None)
    key = keys.request_stream(lanes.lane_stream("requests", lane))
    assert not lanes.remove_lane(redis_client, "requests", lane)
    assert lane in lanes.registered(redis_client, "requests")
    entry = redis_client.xreadgroup(keys.GROUP, "w", {key: ">"})[0][1][0][0]
    redis_client.xdel(key, entry)
    assert not lanes.remove_lane(redis_client, "requests", lane)  # still pending under a consumer
    redis_client.xack(key, keys.GROUP, entry)
    version = redis_client.get(lanes.registry_version_key("requests"))
    assert lanes.remove_lane(redis_client, "requests", lane)
    assert lane not in lanes.registered(redis_client, "requests") and not redis_client.exists(key)
    assert redis_client.get(lanes.registry_version_key("requests")) != version
    with pytest.raises(redis.exceptions.ResponseError):
        redis_client.xinfo_groups(key)


def test_a_lane_unused_for_a_while_wakes_the_workers_again(redis_client, redis_url):
    """Its next request puts a notice on the plain stream (which wakes a blocked worker, and which
    a deployment scaled to zero on the plain stream's lag sees); one in steady use does not."""
    plain = keys.request_stream("requests")
    with Client(redis_url) as client:
        client.submit({"id": "a1", "prompt": "x", "tenant": "alice"}, reply=False)
        client.submit({"id": "a2", "prompt": "x", "tenant": "alice"}, reply=False)
        assert redis_client.xlen(plain) == 1  # the new lane's notice only
        lane = lanes.lane_name("tenant", "alice", None)
        redis_client.zadd(lanes.registry_key("requests"), {lane: 1.0})  # last used long ago
        client.submit({"id": "a3", "prompt": "x", "tenant": "alice"}, reply=False)
        assert redis_client.xlen(plain) == 2
    assert [f[b"lane"].decode() for _, f in redis_client.xrange(plain)] == [lane, lane]


def test_mqinfer_lanes_lists_the_plain_stream_and_every_lane(redis_client, redis_url):
    import json

    from tests import zygote
    from tests.helpers import mqinfer_cmd

    producer = Producer(redis_url)
    producer.submit_many([{"id": f"a{i}", "prompt": "x", "tenant": "alice"} for i in range(3)]
                         + [{"id": "p0", "prompt": "x"}])
    alice = lanes.lane_name("tenant", "alice", None)
    redis_client.xreadgroup(keys.GROUP, "w", {keys.request_stream(lanes.lane_stream("requests", alice)): ">"},
                            count=1)
    out = zygote.run(mqinfer_cmd("lanes", "--redis", redis_url, "--format", "json"), capture_output=True,
                     text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = {row["lane"]: row for row in json.loads(out.stdout)}
    assert set(listed) == {"plain", alice}
    # The plain stream holds the lane's notice and one request.
    assert listed["plain"]["length"] == 2 and listed["plain"]["last_used_s"] is None
    assert (listed[alice]["length"], listed[alice]["unread"], listed[alice]["pending"]) == (3, 2, 1)
    assert listed[alice]["last_used_s"] >= 0
    table = zygote.run(mqinfer_cmd("lanes", "--redis", redis_url), capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and alice in table.stdout and "1 lane and the plain stream" in table.stdout
