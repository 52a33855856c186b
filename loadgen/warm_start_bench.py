"""Workers started cold against workers forked from the warm template (mqinfer.warm_start): how long
each takes from being asked for to joining its consumer group (the first ones, then one more, as a
restart after a crash would), and their proportional memory (PSS) once serving.

    python -m mqinfer.loadgen.warm_start_bench [--model tiny] [--workers 2] [--rounds 3]

Linux only (PSS from /proc). Each round starts the workers cold, then warm (a template of the
bench's own), against an embedded server, and stops them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mqinfer.procs import mqinfer_command
from mqinfer.schemas import keys
from mqinfer.server import EmbeddedServer
from mqinfer.warm_start import WarmStarter


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _joined(client, stream: str, names: set[str]) -> set[str]:
    try:
        groups = client.xinfo_groups(stream)
    except Exception:  # noqa: BLE001 - no stream yet: nobody joined
        return set()
    found = set()
    for group in groups:
        for consumer in client.xinfo_consumers(stream, group["name"]):
            name = consumer["name"]
            found.add(name.decode() if isinstance(name, bytes) else name)
    return found & names


def _start(starter, url: str, client, out: Path, model: str, names: set[str]) -> tuple[list, list[float]]:
    """Start a worker per name; (the processes, seconds until each joined its group)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MQINFER_LOG_LEVEL="warning")
    stream = keys.request_stream("startbench")
    began = time.perf_counter()
    procs = [starter.popen([*mqinfer_command("worker"), "--redis", url, "--out", str(out), "--stream", "startbench",
                            "--model", model, "--consumer", name], env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name in sorted(names)]
    ready_at: dict[str, float] = {}
    while len(ready_at) < len(names):
        for name in _joined(client, stream, names) - set(ready_at):
            ready_at[name] = time.perf_counter() - began
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker exited before it was ready")
        time.sleep(0.01)
    return procs, sorted(ready_at.values())


def one_round(url: str, client, out: Path, model: str, count: int, warm: bool, tag: str) -> dict:
    """``count`` workers started together, then one more beside them (what a restart after a crash
    costs); their PSS once all are serving."""
    starter = WarmStarter(warm=warm, shared=False)  # a template of the bench's own, started now
    procs, ready = _start(starter, url, client, out, model, {f"{tag}-{i}" for i in range(count)})
    more, again = _start(starter, url, client, out, model, {f"{tag}-again"})
    procs += more
    time.sleep(1.0)  # past the group join: the model is loaded and the loop runs
    pss = [_pss_mib(p.pid) for p in procs]
    template = starter.template_pid
    template_pss = _pss_mib(template) if warm and template else 0.0
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)
    starter.close()
    return {"mode": "warm" if warm else "cold", "ready_s": ready, "one_more_ready_s": again[0], "worker_pss_mib": pss,
            "template_pss_mib": template_pss, "total_pss_mib": sum(pss) + template_pss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.warm_start_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="the workers' --model (default: tiny)")
    parser.add_argument("--workers", type=int, default=2, help="workers started together (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="cold-then-warm rounds (default: 3)")
    parser.add_argument("--json", metavar="FILE", help="also write every round here")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("warm_start_bench: Linux only (the warm start and /proc)", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as folder, EmbeddedServer(Path(folder) / "redis") as server:
        client = server.client()
        for r in range(args.rounds):
            for warm in (False, True):
                result = one_round(server.url, client, Path(folder) / "out", args.model, args.workers, warm,
                                   f"r{r}-{'warm' if warm else 'cold'}")
                results.append(result)
                print(f"round {r + 1} {result['mode']}: ready after "
                      + ", ".join(f"{s:.2f}" for s in result["ready_s"])
                      + f" s, one more beside them after {result['one_more_ready_s']:.2f} s; PSS "
                      + ", ".join(f"{m:.0f}" for m in result["worker_pss_mib"]) + " MiB a worker"
                      + (f", template {result['template_pss_mib']:.0f} MiB" if result["mode"] == "warm" else "")
                      + f", {result['total_pss_mib']:.0f} MiB in all", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
