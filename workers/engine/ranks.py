"""The ranks of a tensor- or pipeline-parallel worker as processes: ``Leader`` (rank 0, the worker
process, which starts the others and speaks to them) and ``follower_main`` (every other rank, run as
``python -m mqinfer.workers.engine.tp_rank``).

How the model is split, the step plan and the group's collectives are in ``workers/engine/parallel.py``;
the pipeline's stages in ``workers/engine/pipeline.py``. This module is above both and above the model
runner, which a rank runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec
import torch

from mqinfer.procs import mqinfer_command
from mqinfer.warm_start import SHARED, WarmStarter
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.schemas import faults
from mqinfer.workers.heap import freeze_startup_heap
from mqinfer.workers.engine.loader import load_model, resolve_dtype
from mqinfer.workers.engine.model_runner import ModelRunner
from mqinfer.workers.engine.parallel import (
    PLAN_DECODER, Group, RankFailure, RankSettings, init_group, rank_parts, read_frame, use_device, write_frame,
)
from mqinfer.workers.engine.pipeline import StageRunner, join_pipeline

log = logging.getLogger(__name__)


def _join(init_method: str, rank: int, size: int, pipeline: int, device: str,
          leader: "Leader | None" = None) -> Group:
    """Join the group of ``size`` ranks: one tensor-parallel group, or ``pipeline`` stages of them."""
    if pipeline == 1:
        return init_group(init_method, rank, size, device, leader)
    return join_pipeline(init_method, rank, size // pipeline, pipeline, device, leader)


class Leader:
    """Rank 0: starts the other ranks, joins the group with them, sends them their messages (over
    their standard input) and hears from them when they are ready (over their standard output),
    and watches that they live. A rank that dies closes its pipes, so rank 0 never waits on it.

    Where the worker can reach a shared warm template (``MQINFER_WARM_TEMPLATE``,
    :mod:`mqinfer.warm_start`), the other ranks are forked from it instead of importing PyTorch and
    the engine each; either way each gets SIGKILL when this process dies."""

    def __init__(self, devices: list[str], pipeline: int = 1) -> None:
        """``devices``: each rank's, in rank order; ``pipeline``: the pipeline stages they make
        (``workers/engine/pipeline.py``), each of ``len(devices) / pipeline`` tensor-parallel ranks."""
        self.size = len(devices)
        self.pipeline, self.tensor = pipeline, len(devices) // pipeline
        if pipeline < 1 or self.tensor * pipeline != self.size:
            raise ValueError(f"{self.size} ranks do not make {pipeline} pipeline stages")
        self._dir = tempfile.mkdtemp(prefix="mqinfer-tp-")
        init = "file://" + os.path.join(self._dir, "rendezvous")
        self.procs: list = []  # subprocess.Popen, or WarmProcess where forked
        self._to: list = []  # each rank's standard input (binary file), in rank order
        self._from: list = []  # and its standard output
        self.group: Group | None = None
        # Forked only from a shared template: one of this worker's own would import as much as the
        # ranks it saves them from. Without one, each rank starts cold.
        self._starter = WarmStarter(warm=None if os.environ.get(SHARED) else False)
        try:
            use_device(devices[0])
            for rank in range(1, self.size):
                argv = [*mqinfer_command()[:-1], "mqinfer.workers.engine.tp_rank", "--init", init, "--rank", str(rank),
                        "--size", str(self.size), "--device", devices[rank], "--pipeline", str(pipeline)]
                self._start(argv)
                log.info("started %s (pid %d)", self.name(rank), self.procs[-1].pid)
            self._hear("started")  # every rank has its device and is about to join
            self.group = _join(init, 0, self.size, pipeline, devices[0], self)
        except BaseException:
            self.close()
            raise

    def _start(self, argv: list[str]) -> None:
        """Start one rank, its standard input and output being pipes to this process."""
        to_rank, from_rank = os.pipe(), os.pipe()
        try:
            # SIGKILL: a rank must not outlive its worker, whatever the worker was doing.
            proc = self._starter.popen(argv, stdin=to_rank[0], stdout=from_rank[1], death_signal=signal.SIGKILL)
        except BaseException:
            for fd in (*to_rank, *from_rank):
                os.close(fd)
            raise
        os.close(to_rank[0])
        os.close(from_rank[1])
        self.procs.append(proc)
        self._to.append(os.fdopen(to_rank[1], "wb"))
        self._from.append(os.fdopen(from_rank[0], "rb"))

    def _hear(self, word: str) -> None:
        """Wait for a line ``word`` from every other rank, failing at once if one exits instead."""
        waiting = {out.fileno(): rank for rank, out in enumerate(self._from, start=1)}
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], 1.0)
            for fd in ready:
                rank = waiting.pop(fd)
                line = self._from[rank - 1].readline().decode(errors="replace").strip()
                if line != word:
                    self.procs[rank - 1].wait(timeout=30)
                    self.check_alive()
                    raise RankFailure(f"{self.name(rank)} said {line!r} instead of {word!r}")
            if waiting:
                self.check_alive()

    def name(self, rank: int) -> str:
        """How messages name a rank: by its stage too when the worker is a pipeline."""
        if self.pipeline == 1:
            return f"tensor-parallel rank {rank}"
        return f"pipeline rank {rank} (stage {rank // self.tensor} of {self.pipeline})"

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankFailure(f"{self.name(rank)} exited with code {code}")

    def send(self, message: msgspec.Struct | None) -> None:
        """One message to every other rank (None: stop)."""
        for rank, inbox in enumerate(self._to, start=1):
            try:
                write_frame(inbox, message)
            except (BrokenPipeError, OSError) as exc:
                self.check_alive()
                raise RankFailure(f"{self.name(rank)} is gone ({exc})") from None

    def load(self, settings: RankSettings) -> None:
        """Send the other ranks the engine settings, so that they load their shards while this
        rank loads its own."""
        self.check_alive()
        self.send(settings)

    def ready(self, scheduler_config: SchedulerConfig) -> None:
        """Send the KV cache's size (the scheduler's settings) and wait until every rank has built
        its cache. ``RankFailure`` when one failed on the way (its log is above)."""
        self.send(scheduler_config)
        self._hear("ready")

    def close(self) -> None:
        """Tell the other ranks to stop, wait a little, then end those that remain."""
        group, self.group = self.group, None
        for inbox in self._to:
            try:
                write_frame(inbox, None)
                inbox.close()
            except OSError:  # a rank is gone: nothing to tell it
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for out in self._from:
            out.close()
        self._starter.close()
        if group is not None:
            group.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def follower_main(argv: list[str] | None = None) -> int:
    """A rank other than 0: join the group, load this rank's shard, then run every plan rank 0
    sends on standard input until it sends a stop or goes away."""
    parser = argparse.ArgumentParser(prog="mqinfer tensor-parallel rank")
    parser.add_argument("--init", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--pipeline", type=int, default=1)
    args = parser.parse_args(argv)
    # Rank 0 decides when this rank stops (it sends a stop, or goes away and takes this process
    # with it): a Ctrl-C reaching the whole process group must not end it before rank 0 has drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("MQINFER_LOG_LEVEL", "warning").upper(),
                        format=f"%(asctime)s rank {args.rank} %(levelname)s %(name)s: %(message)s")
    # Standard output is this rank's line to rank 0: keep it for that alone, and send whatever else
    # would print there (Python or native code) to standard error, the worker's log.
    inbox, outbox = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    use_device(args.device)
    outbox.write(b"started\n")
    outbox.flush()
    group = _join(args.init, args.rank, args.size, args.pipeline, args.device)
    data = read_frame(inbox)
    if data is None:
        return 0
    settings = msgspec.msgpack.decode(data, type=RankSettings)
    config = settings.engine
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(settings.num_threads)
    shard, stage = rank_parts(args.rank, args.size, args.pipeline)
    model, info = load_model(config.model, device, config.dtype, shard=shard, stage=stage)
    data = read_frame(inbox)
    if data is None:  # rank 0 failed while starting
        return 0
    scheduler_config = msgspec.msgpack.decode(data, type=SchedulerConfig)
    runner_class = ModelRunner if stage is None else StageRunner
    runner = runner_class(model, info, scheduler_config, device, resolve_dtype(info.dtype),
                          kv_cache_dtype=config.kv_cache_dtype, group=group)
    freeze_startup_heap()
    outbox.write(b"ready\n")
    outbox.flush()
    with torch.inference_mode():
        while (data := read_frame(inbox)) is not None:
            faults.hit("tp.rank_step")
            runner.run_plan(PLAN_DECODER.decode(data))
    group.close()
    return 0


__all__ = ["Leader", "follower_main"]
