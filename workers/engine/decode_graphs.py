"""Decode-only steps over static, padded input buffers: CUDA graphs on a GPU, the same path eagerly on CPU.

A decode-only step (every scheduled sequence adds one token) has the same shape as every other
decode step of its batch size, so on CUDA it can be captured once as a ``torch.cuda.CUDAGraph``
and replayed: one launch for the whole forward pass instead of one per kernel from Python.
``DecodeGraphs`` keeps one set of static input buffers (token ids, positions, KV slots, context
lengths, block tables) sized for the largest batch, and one attention metadata per *padded batch
size* (``padded_sizes``: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, and
``max_num_seqs`` itself). A step of ``B`` sequences is padded to the smallest size ``P >= B``:
its inputs are written into the first ``B`` rows of the buffers, the other ``P - B`` rows are
one-token sequences that write their K and V into a *scratch block* no request ever holds
(``enable_decode_graphs`` takes it from the scheduler's pool once, for good), and the model runs
over all ``P`` rows; the first ``B`` rows of its output are the step's.

On CUDA each size is captured at start-up (largest first, all sharing one memory pool); a size
whose capture fails leaves the engine eager, with the reason logged. On CPU nothing is captured:
the same padded static-buffer path runs eagerly (the stand-in through which the tests hold the
padded path to the eager one). Steps with prompt tokens, and batches larger than the largest
size, run eagerly in any case (``accepts``).

The attention kernels' index checks read the device's indices back to the host, which a graph
cannot do; on CUDA they run once at capture, and for every replay ``run`` checks the step's
block ids and context lengths on the host instead (the inputs it writes are all it reads).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from mqinfer.kernels.attention import AttentionMetadata, AttentionWorkspace, build_attention_metadata

log = logging.getLogger(__name__)


def padded_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes with a graph (or, on CPU, a static metadata): 1, 2, 4, 8, then every 8 up
    to 64 and every 16 beyond, and ``max_num_seqs`` itself, none above it."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def padded_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``batch`` sequences; None when none does."""
    at = bisect.bisect_left(sizes, batch)
    return sizes[at] if batch >= 1 and at < len(sizes) else None


class DecodeGraphs:
    """Static buffers, per-size metadata and (on CUDA) captured graphs for decode-only steps.

    ``model(ids, positions, kv_caches, metadata) -> hidden`` is the runner's model;
    ``max_blocks`` the widest block table a sequence can have (``max_model_len / block_size``
    rounded up); ``scratch_block`` a KV block that no request will ever be given.
    """

    def __init__(self, model, kv_caches, *, block_size: int, num_queries_per_kv: int, max_num_seqs: int,
                 max_blocks: int, scratch_block: int, device: torch.device | str,
                 workspace: AttentionWorkspace | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_queries_per_kv = num_queries_per_kv
        self.sizes = padded_sizes(max_num_seqs)
        self.max_blocks = max(1, max_blocks)
        self.num_blocks = int(kv_caches[0][0].shape[0])
        if not 0 <= scratch_block < self.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not one of the cache's {self.num_blocks} blocks")
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.workspace = workspace or AttentionWorkspace()
        largest = self.sizes[-1]
        i64 = {"dtype": torch.int64, "device": self.device}
        self.input_ids = torch.zeros(largest, **i64)
        self.positions = torch.zeros(largest, **i64)
        self.slot_mapping = torch.zeros(largest, **i64)
        self.seq_lens = torch.ones(largest, **i64)
        self.block_tables = torch.zeros(largest, self.max_blocks, **i64)
        # One token per sequence: the query layout and token-to-sequence map never change.
        self.query_start_loc = torch.arange(largest + 1, **i64)
        self.seq_of_token = torch.arange(largest, **i64)
        self.metadata = {size: self._static_metadata(size) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.setup_seconds = 0.0
        self.replays = 0  # decode steps run through this path (graph or stand-in)
        self._kept_alive: list[torch.Tensor] = []

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _static_metadata(self, size: int) -> AttentionMetadata:
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            positions=self.positions[:size], block_size=self.block_size,
            num_queries_per_kv=self.num_queries_per_kv, seq_of_token=self.seq_of_token[:size],
            workspace=self.workspace)
        metadata.max_seq_len = self.max_blocks * self.block_size
        return metadata

    def accepts(self, query_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> bool:
        """Whether a step runs here: every sequence adds exactly one token, the batch fits the
        largest size and every block table the buffers' width."""
        return (bool(query_lens) and len(query_lens) <= self.sizes[-1] and all(q == 1 for q in query_lens)
                and all(len(t) <= self.max_blocks for t in block_tables))

    def set_up(self) -> float:
        """Capture every size on CUDA (the CPU needs nothing more): the seconds it took."""
        began = time.perf_counter()
        if self.device.type == "cuda":
            self._capture()
        self.setup_seconds = time.perf_counter() - began
        return self.setup_seconds

    def _pad_rows(self, size: int) -> None:
        """Every row a one-token sequence in the scratch block (what padded rows hold)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.seq_lens[:size].fill_(1)
        self.block_tables[:size].fill_(self.scratch_block)
        self.slot_mapping[:size].fill_(self.scratch_block * self.block_size)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            metadata = self.metadata[size]
            self._pad_rows(size)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: the kernels compiled and the index checks done, outside the graph
                    self.model(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        # The graphs write into the activation buffers the model held while they were captured; a
        # larger eager step later replaces a buffer with a bigger one, so the captured ones are
        # kept alive here (and never handed to anything else).
        activations = getattr(self.model, "activations", None)
        self._kept_alive = activations.tensors() if activations is not None else []

    def _check(self, seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
        for b, (s, table) in enumerate(zip(seq_lens, block_tables)):
            if not 1 <= s <= len(table) * self.block_size:
                raise ValueError(f"sequence {b}: context {s} outside its {len(table)} blocks of {self.block_size}")
            if table and not (0 <= min(table) and max(table) < self.num_blocks):
                raise ValueError(f"sequence {b}: block ids outside 0..{self.num_blocks - 1}")

    def run(self, input_ids: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]
            ) -> torch.Tensor:
        """The final hidden states ``[B, hidden]`` of a decode-only step: ``input_ids[b]`` is
        sequence ``b``'s new token at position ``seq_lens[b] - 1``. On CUDA the rows are views of
        the graph's output, valid until the next step."""
        batch = len(input_ids)
        if not self.accepts([1] * batch, block_tables) or len(seq_lens) != batch or len(block_tables) != batch:
            raise ValueError(f"not a decode-only step of at most {self.sizes[-1]} sequences")
        size = padded_size(batch, self.sizes)
        self._check(seq_lens, block_tables)
        pad = size - batch
        # The padded step's indices built on the host in one go, then copied into the buffers.
        host = build_attention_metadata(
            [1] * size, [*seq_lens, *([1] * pad)],
            [*block_tables, *([[self.scratch_block]] * pad)], self.block_size, self.num_queries_per_kv)
        width = host.block_tables.shape[1]
        ids = torch.tensor([*input_ids, *([0] * pad)], dtype=torch.int64)
        self.input_ids[:size].copy_(ids, non_blocking=True)
        self.positions[:size].copy_(host.positions, non_blocking=True)
        self.slot_mapping[:size].copy_(host.slot_mapping, non_blocking=True)
        self.seq_lens[:size].copy_(host.seq_lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(host.block_tables, non_blocking=True)
        self.block_tables[:size, width:].zero_()
        self.replays += 1
        graph = self.graphs.get(size)
        if graph is not None:
            graph[0].replay()
            return graph[1][:batch]
        metadata = self.metadata[size]
        # Eager (the CPU stand-in): the kernels check this step's indices again, and the
        # PyTorch attention path plans its groups from the padded host lists.
        metadata.new_step(host.max_seq_len, host.planner())
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)[:batch]


def decode_graphs_wanted(config, device: torch.device) -> str | None:
    """None when an engine with ``config`` on ``device`` should run decode steps through
    ``DecodeGraphs`` at start-up, else why not."""
    if getattr(config, "enforce_eager", False):
        return "--enforce-eager"
    if device.type != "cuda":
        return "not on CUDA (the CPU runs every step eagerly)"
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        return "tensor or pipeline parallel"
    if config.speculative != "none":
        return "speculative decoding (its steps carry proposals)"
    return None


def enable_decode_graphs(engine) -> DecodeGraphs:
    """Give ``engine``'s model runner a ``DecodeGraphs``: one KV block taken from the scheduler's
    pool for good as the scratch block, the buffers and metadata built and, on CUDA, every size
    captured (on failure the runner stays eager and the reason is logged). Call it at start-up,
    before any request holds blocks."""
    runner, scheduler = engine.runner, engine.scheduler
    if runner.group is not None or runner.draft is not None:
        raise ValueError("decode graphs run on one rank without a draft model")
    (scratch,) = scheduler.kv_cache_manager.block_pool.allocate(1)
    config = scheduler.config
    graphs = DecodeGraphs(runner.model, runner.kv_caches, block_size=runner.block_size,
                          num_queries_per_kv=runner.num_queries_per_kv, max_num_seqs=config.max_num_seqs,
                          max_blocks=-(-config.max_model_len // runner.block_size),
                          scratch_block=scratch.block_id, device=runner.device, workspace=runner.workspace)
    try:
        seconds = graphs.set_up()
    except Exception as exc:  # a model that cannot be captured still runs, eagerly
        scheduler.kv_cache_manager.block_pool.free([scratch])
        log.warning("decode graphs: capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
        return graphs
    runner.decode_graphs = graphs
    what = "captured" if graphs.captured else "set up (CPU: eager over the static buffers)"
    log.info("decode graphs: %d batch sizes (%s) %s in %.2fs", len(graphs.sizes),
             ",".join(map(str, graphs.sizes)), what, seconds)
    return graphs
