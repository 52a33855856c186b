"""`mqinfer run` as a user runs it, with real processes: re-runs resume, Ctrl-C and kill -9 lose and
double nothing, one run per output folder, no process outlives its run, and clear one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests import zygote
from tests.helpers import LineCollector, rows, wait_until, write_jsonl

LOCK = Path(".mqinfer") / "run.lock"


def run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mqinfer", "run", *args]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MQINFER_NUM_THREADS="1", MQINFER_WORKERS="1")


def requests(n: int, max_tokens: int, prefix: str = "r") -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt_token_ids": [5 + i % 50, 6, 7, 8], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True} for i in range(n)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def lock_info(out: Path) -> dict:
    try:
        return json.loads((out / LOCK).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def server_pid(out: Path) -> int | None:
    """The embedded server's pid, found by its data folder on its command line."""
    data = str(out / ".mqinfer" / "redis")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if data.encode() in argv and any(b"server" in a for a in argv[:1]):
                return int(entry.name)
    return None


def check_once(out: Path, ids: list[str]) -> None:
    """Exactly one result row and one billed computation (request cost row) per request."""
    results = rows(out / "results")
    assert sorted(r["id"] for r in results) == sorted(ids)
    billed = Counter(c["id"] for c in rows(out / "costs") if c["kind"] == "request")
    assert billed == Counter(ids), {k: v for k, v in billed.items() if v != 1}


def test_rerun_after_kill_9_resumes_and_leaves_no_process(tmp_path):
    items = requests(24, 100)
    src = write_jsonl(tmp_path / "job.jsonl", items)
    out = tmp_path / "out"
    args = run_cmd(str(src), "--out", str(out), "--max-num-seqs", "4", "--flush-rows", "1")
    proc = zygote.popen(args, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(rows(out / "results")) >= 8, timeout=180, what="the first rows")
        children = lock_info(out)["children"]
        server = server_pid(out)
        assert children and server
        # The Redis password is not on any command line `ps` shows.
        for pid in [*children, server]:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"unix://:" not in cmdline and b"redis://:" not in cmdline
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    # Its server and workers notice their parent died and exit within seconds: a worker does not
    # keep retrying acks against a server that died with the run.
    wait_until(lambda: not any(alive(p) for p in [*children, server]), timeout=15,
               what="the killed run's workers and server to exit")
    first = len(rows(out / "results"))
    assert 8 <= first < 24

    again = zygote.run(args, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    assert "24 of 24 requests have rows: 24 length" in again.stdout
    check_once(out, [r["id"] for r in items])
    assert len({r["job_id"] for r in rows(out / "results")}) == 1

    # Complete: a third run computes nothing and says so.
    third = zygote.run(args, env=env(), capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr
    assert "nothing to compute" in third.stderr and "this run: nothing computed" in third.stdout
    check_once(out, [r["id"] for r in items])
    assert not any(alive(p) for p in lock_info(out)["children"])



def test_one_run_per_folder_and_double_ctrl_c(tmp_path):
    items = requests(30, 150)
    src = write_jsonl(tmp_path / "job.jsonl", items)
    out = tmp_path / "out"
    args = run_cmd(str(src), "--out", str(out), "--max-num-seqs", "4", "--flush-rows", "1")
    first = zygote.popen(args, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = LineCollector(first.stderr)
    try:
        wait_until(lambda: len(rows(out / "results")) >= 2, timeout=180, what="the first rows")
        second = zygote.run(args, env=env(), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
        # Two Ctrl-Cs: the run still waits for its workers to write and acknowledge what they finished.
        # The second is sent once the first was handled (two at once would arrive as one).
        first.send_signal(signal.SIGINT)
        wait_until(lambda: stderr.count(lambda line: "mqinfer run: stopping:" in line), timeout=60,
                   what="the first Ctrl-C to be handled")
        first.send_signal(signal.SIGINT)
        first.wait(timeout=120)
        err = stderr.text()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, err
    assert "still stopping" in err and "run the same command again" in err
    assert not any(alive(p) for p in lock_info(out)["children"])
    assert server_pid(out) is None
    done = len(rows(out / "results"))
    assert 2 <= done < 30

    resumed = zygote.run(args, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({done} rows from earlier runs)" in resumed.stdout
    check_once(out, [r["id"] for r in items])


def test_small_first_contact_errors(tmp_path):
    out = tmp_path / "out"
    # An empty input is a job of 0 requests.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = zygote.run(run_cmd(str(empty), "--out", str(out)), env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "0 of 0 requests have rows" in proc.stdout

    src = write_jsonl(tmp_path / "job.jsonl", requests(3, 2))
    # --fresh starts over: the same requests, computed once more, billed once.
    done = zygote.run(run_cmd(str(src), "--out", str(out)), env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fresh = zygote.run(run_cmd(str(src), "--out", str(out), "--fresh"), env=env(), capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr
    assert "removed 3 result rows and 3 cost rows" in fresh.stderr and "this run: 3 requests" in fresh.stdout
    check_once(out, ["r0", "r1", "r2"])
    # A bad flag fails before anything is submitted or written.
    proc = zygote.run(run_cmd(str(src), "--out", str(tmp_path / "o2"), "--max-batch", "0"), env=env(),
                      capture_output=True, text=True)
    assert proc.returncode == 2 and "--max-batch must be >= 1" in proc.stderr
    assert not (tmp_path / "o2" / "results").exists()
    # A misspelt config key is named, not ignored.
    cfg = tmp_path / "mq.toml"
    cfg.write_text("max_bacth = 8\n[worker]\nblock-size = 32\n")
    proc = zygote.run(run_cmd(str(src), "--out", str(out), "--config", str(cfg)), env=env(),
                      capture_output=True, text=True)
    assert proc.returncode == 2 and "max_bacth is not a flag of any command" in proc.stderr
    assert "block-size" not in proc.stderr  # a known key of another command's table is fine
    # A folder that is no checkpoint: refused before anything starts, once, no traceback.
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    proc = zygote.run(run_cmd(str(src), "--out", str(tmp_path / "o3"), "--model", str(not_a_model)), env=env(),
                      capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("file not found (a checkpoint folder needs config.json)") == 1
    assert "Traceback" not in proc.stderr and "--log-level" not in proc.stderr and "submitted" not in proc.stderr
    # Workers that cannot load the model (an architecture they do not run): their reason, and the
    # run says that none got as far as reading a request.
    (not_a_model / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    proc = zygote.run(run_cmd(str(src), "--out", str(tmp_path / "o3"), "--model", str(not_a_model)), env=env(),
                      capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unsupported architecture ['BertModel']" in proc.stderr
    assert "every worker exited before it was ready" in proc.stderr
    assert "Traceback" not in proc.stderr and "--log-level" not in proc.stderr
    # A wrong password is one line, not a traceback, and is not retried.
    from mqinfer.server import EmbeddedServer

    with EmbeddedServer(tmp_path / "redis", appendonly=False) as server:
        wrong = server.url.replace(server.password, "not-the-password")
        start = time.monotonic()
        proc = zygote.run([sys.executable, "-m", "mqinfer", "submit", str(src), "--redis", wrong],
                          capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and time.monotonic() - start < 30
        assert "cannot authenticate" in proc.stderr and "Traceback" not in proc.stderr
        assert "not-the-password" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_run_from_a_folder_holding_a_folder_named_mqinfer_and_expired_rows(tmp_path):
    # `python -m` would put the current folder first on the import path, where an unrelated
    # `mqinfer/` folder (a clone, run from its parent) would hide the installed package.
    (tmp_path / "mqinfer").mkdir()
    items = [{"id": "ok", "prompt": "hello", "max_tokens": 3, "temperature": 0},
             {"id": "late", "prompt": "hello", "max_tokens": 3, "deadline": 1.0},
             {"id": "bad", "prompt": "x", "max_tokens": -1}]
    src = write_jsonl(tmp_path / "job.jsonl", items)
    console_script = Path(sys.executable).with_name("mqinfer")  # what a user types: the installed command
    assert console_script.exists()
    proc = subprocess.run([str(console_script), "run", "job.jsonl", "--out", "out"], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    reasons = {r["id"]: r["finish_reason"] for r in rows(tmp_path / "out" / "results")}
    assert reasons == {"ok": "length", "late": "expired", "bad": "error"}
    # Each finish reason is counted as the rows say, not folded into "ok".
    assert "3 of 3 requests have rows: " in proc.stdout
    line = proc.stdout.splitlines()[0]
    assert "1 length" in line and "1 expired" in line and "1 error (invalid_request 1)" in line


def test_worker_command_line_carries_every_setting_but_no_password(tmp_path, monkeypatch):
    from mqinfer.cli import build_parser
    from mqinfer.config import resolve
    from mqinfer.run import worker_argv

    monkeypatch.setenv("MQINFER_PREFIX_CACHE", "true")  # the command line's --no- form wins over it
    args = build_parser().parse_args(["run", "in.jsonl", "--out", str(tmp_path), "--no-prefix-cache",
                                      "--max-batch", "8", "--redis", "redis://:secret@127.0.0.1:1/0"])
    opts = resolve(args, args._options, {}, args._required)
    argv = worker_argv(opts, tmp_path, 0, "requests")
    assert argv[1:5] == ["-P", "-m", "mqinfer", "worker"]
    assert "--no-prefix-cache" in argv and argv[argv.index("--max-batch") + 1] == "8"
    assert not any("secret" in a for a in argv) and "--redis" not in argv


def test_workers_auto_layout():
    from mqinfer.layout import choose_layout

    base = {"workers": "auto", "num_threads": None, "shards": 1, "device": "auto", "model": "tiny"}
    gib = 1 << 30
    assert choose_layout(base, cores=2, gpu=False, memory=16 * gib)[:2] == (2, 1)  # one 1-thread worker per core
    assert choose_layout({**base, "num_threads": 2}, cores=2, gpu=False, memory=16 * gib)[:2] == (1, 2)
    assert choose_layout({**base, "num_threads": 4}, cores=8, gpu=False, memory=16 * gib)[:2] == (2, 4)
    assert choose_layout(base, cores=4, gpu=True, memory=16 * gib)[:2] == (1, None)
    assert choose_layout({**base, "shards": 3}, cores=2, gpu=False, memory=16 * gib)[0] == 3  # a worker per shard
    # Half of 40 MiB holds one copy of a 16 MiB model: one worker, with every core.
    assert choose_layout(base, cores=4, gpu=False, memory=40 << 20)[:2] == (1, 4)
    assert choose_layout({**base, "workers": 3, "num_threads": 2}, cores=2, gpu=False)[:2] == (3, 2)  # explicit wins
    # Each rank of a tensor-parallel worker is a process of its own: two ranks fill two cores.
    assert choose_layout({**base, "tensor_parallel_size": 2}, cores=2, gpu=False, memory=16 * gib)[:2] == (1, 1)


def test_run_with_int8_weights(tmp_path):
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "job.jsonl", requests(4, 6))
    proc = zygote.run(run_cmd(str(src), "--out", str(out), "--quantization", "w8a8"),
                      env=dict(env(), MQINFER_LOG_LEVEL="info"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    check_once(out, ["r0", "r1", "r2", "r3"])
    assert all(len(r["output_token_ids"]) == 6 for r in rows(out / "results"))
    # The worker (its log at info level on the run's stderr) says what it quantized.
    assert ("quantization w8a8: 17 projections hold int8 weights, the LM head among them (13 smoothed, alpha 0.7)"
            in proc.stderr)


def test_prefix_order_and_routing_give_the_same_rows_as_input_order(tmp_path):
    # Prompts that share 72-token prefixes, interleaved: --order prefix (the default) submits them
    # grouped, and with two shards each prefix's requests go to one shard's worker.
    shared = [[11 + (i % 50) for i in range(72)], [101 + (i % 60) for i in range(72)],
              [7 + (i * 7) % 250 for i in range(72)], [251 - (i % 40) for i in range(72)]]
    reqs = [{"id": f"q{i}", "prompt_token_ids": shared[i % 4] + [30 + i], "max_tokens": 5, "temperature": 0,
             "ignore_eos": True} for i in range(16)]
    src = write_jsonl(tmp_path / "job.jsonl", reqs)
    outputs = {}
    runs = {"input": ["--order", "input"], "prefix": ["--order", "prefix"],
            "routed": ["--shards", "2", "--workers", "2", "--num-threads", "1"]}
    for name, flags in runs.items():
        out = tmp_path / name
        proc = zygote.run(run_cmd(str(src), "--out", str(out), *flags), env=env(),
                          capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        check_once(out, [r["id"] for r in reqs])
        got = rows(out / "results")
        outputs[name] = {r["id"]: (r["finish_reason"], list(r["output_token_ids"])) for r in got}
        if name == "routed":
            assert "routing by prefix: work per shard" in proc.stderr
            worker_of = {r["id"]: r["worker"] for r in got}
            for p in range(4):
                assert len({worker_of[f"q{i}"] for i in range(p, 16, 4)}) == 1  # one worker per prefix
            assert len(set(worker_of.values())) == 2  # and both workers got prefixes
    assert outputs["prefix"] == outputs["input"] == outputs["routed"]


def test_a_run_with_choices_counts_requests_and_keeps_every_choice(tmp_path):
    """A request with ``n`` choices has a row per choice: the run counts it as one request with
    rows (exit 0), and the results keep every choice."""
    items = requests(3, 4)
    items[1]["n"] = 3
    items[1]["temperature"] = 0.8
    items[1]["seed"] = 7
    src = write_jsonl(tmp_path / "job.jsonl", items)
    out = tmp_path / "out"
    done = zygote.run(run_cmd(str(src), "--out", str(out)), env=env(), capture_output=True, text=True,
                      timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ": 3 of 3 requests have rows: 3 length" in done.stdout, done.stdout
    results = rows(out / "results")
    assert sorted((r["id"], r["index"] or 0) for r in results) == [
        ("r0", 0), ("r1", 0), ("r1", 1), ("r1", 2), ("r2", 0)]


def test_run_takes_a_file_uri_as_its_folder(tmp_path):
    src = write_jsonl(tmp_path / "job.jsonl", requests(2, 2))
    done = zygote.run(run_cmd(str(src), "--out", (tmp_path / "o").as_uri()), env=env(), capture_output=True,
                      text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    check_once(tmp_path / "o", ["r0", "r1"])
