"""KV tiers end to end in the engine (tiny model, float32, 8-bit KV cache): greedy outputs identical
with tiers on and off while the device cache evicts, after a restart from the disk tier, between two
engines sharing a directory; a corrupt or foreign block on disk is a counted miss and never used."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.engine import kv_codec
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 16
# One block of the tiny model's KV in float32: layers, K and V, KV heads, head_dim, 4 bytes, tokens.
FLOAT32_BLOCK_BYTES = 4 * 2 * 2 * 64 * 4 * BLOCK


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def prompts(num_prefixes: int = 5, per_prefix: int = 3, prefix_blocks: int = 4, seed: int = 0) -> list[list[int]]:
    """Requests cycling over shared prefixes (each followed by a short tail of its own): with a
    device cache smaller than the prefixes together, each comes back after it was evicted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(prefix_blocks * BLOCK)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(256) for _ in range(rng.randint(1, 9))]
            for i in range(num_prefixes * per_prefix)]


def engine(**tiers) -> LLMEngine:
    # 14 blocks: one request at a time fits (at most 6 blocks), two prefixes' blocks do not stay.
    return LLMEngine(EngineConfig(kv_cache_dtype="int8", num_kv_blocks=14, max_num_seqs=2, max_model_len=256,
                                  num_threads=1, **tiers))


def run(eng: LLMEngine, batch: list[list[int]], tag: str = "r") -> dict[str, tuple]:
    """Feed the requests two at a time; each request id -> (output tokens, cached, per-tier cached)."""
    done = {}
    for start in range(0, len(batch), 2):
        for i in range(start, min(start + 2, len(batch))):
            eng.add_request(f"{tag}{i}", batch[i], GREEDY)
        while eng.has_unfinished():
            for out in eng.step().outputs:
                if out.finished:
                    done[out.request_id] = (out.output_token_ids, out.num_cached_tokens, out.tier_cached_tokens or {})
    return done


def tokens(done):
    return {rid: out[0] for rid, out in done.items()}


@pytest.fixture(scope="module")
def reference():
    batch = prompts()
    eng = engine()
    try:
        return batch, run(eng, batch)
    finally:
        eng.close()


def tier_stats(eng):
    return {s["tier"]: s for s in eng.kv_tiers.snapshot()}


def test_tiers_serve_evicted_prefixes_and_change_no_output(reference, tmp_path):
    batch, expected = reference
    # Without tiers the device cache keeps no prefix until it comes back.
    assert sum(out[1] for out in expected.values()) == 0
    eng = engine(kv_host_cache_gib=0.01, kv_disk_cache=str(tmp_path / "kv"))
    try:
        done = run(eng, batch)
        assert eng.kv_tiers.flush()
        stats = tier_stats(eng)
    finally:
        eng.close()
    assert tokens(done) == tokens(expected)
    repeats = [rid for i, rid in enumerate(f"r{i}" for i in range(len(batch))) if i >= 5]
    assert all(done[rid][2].get("host") == 4 * BLOCK for rid in repeats), {r: done[r][2] for r in repeats}
    assert stats["host"]["hits"] == 4 * len(repeats) and stats["host"]["prefix_tokens"] == 4 * BLOCK * len(repeats)
    # Every prompt block was written to disk once, compressed.
    files = list((tmp_path / "kv").iterdir())
    assert len(files) == stats["disk"]["stored_blocks"] > 0
    assert stats["disk"]["written_bytes"] < stats["host"]["written_bytes"]


def test_a_restarted_engine_takes_its_prefixes_from_disk(reference, tmp_path):
    batch, expected = reference
    first = engine(kv_disk_cache=str(tmp_path / "kv"))
    try:
        run(first, batch)
    finally:
        first.close()  # writes what is queued
    again = engine(kv_disk_cache=str(tmp_path / "kv"))
    try:
        done = run(again, batch)
        stats = tier_stats(again)
    finally:
        again.close()
    assert tokens(done) == tokens(expected)
    assert all(out[2] == {"disk": 4 * BLOCK} for out in done.values())
    assert stats["disk"]["hits"] == 4 * len(batch) and not stats["disk"]["rejected"]


def test_two_engines_share_a_disk_tier(reference, tmp_path):
    batch, expected = reference
    folder = str(tmp_path / "kv")
    a, b = engine(kv_disk_cache=folder), engine(kv_disk_cache=folder, kv_host_cache_gib=0.01)
    try:
        first_half = run(a, batch[:5], tag="r")
        assert a.kv_tiers.flush()
        second_half = run(b, batch[5:], tag="s")
    finally:
        a.close()
        b.close()
    assert tokens(first_half) == {f"r{i}": expected[f"r{i}"][0] for i in range(5)}
    assert {f"r{5 + int(rid[1:])}": out[0] for rid, out in second_half.items()} == \
        {f"r{i}": expected[f"r{i}"][0] for i in range(5, len(batch))}
    # The second engine computed none of the five prefixes: the first one's files served them.
    assert all(out[2].get("disk", 0) + out[2].get("host", 0) == 4 * BLOCK for out in second_half.values())


def test_corrupt_and_foreign_blocks_are_misses_and_never_used(reference, tmp_path):
    batch, expected = reference
    folder = tmp_path / "kv"
    first = engine(kv_disk_cache=str(folder))
    try:
        run(first, batch[:5])
    finally:
        first.close()
    files = sorted(folder.iterdir())
    assert len(files) == 20  # five prefixes of four blocks (the tails are partial blocks)
    damaged = files[:3]
    for path in damaged[:2]:  # a flipped byte, then a torn write
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data) if path is damaged[0] else bytes(data[: len(data) // 3]))
    # A block of another model under this key: a file copied from a foreign cache.
    donor = files[3].read_bytes()
    identity, block_hash = kv_codec.peek_key(donor)
    blob = bytearray(donor)
    blob[8:24] = bytes(16)  # another identity; checksum recomputed so only the identity is wrong
    body = bytes(blob[:-16])
    damaged[2].write_bytes(body + hashlib.blake2b(body, digest_size=16).digest())
    again = engine(kv_disk_cache=str(folder))
    try:
        done = run(again, batch)
        stats = tier_stats(again)
    finally:
        again.close()
    assert tokens(done) == tokens(expected)
    assert stats["disk"]["rejected"] == {"corrupt": 1, "torn": 1, "foreign": 1}
    # The bad files were dropped (and the blocks recomputed and written again, whole).
    for path in damaged:
        assert not path.exists() or kv_codec.peek_key(path.read_bytes())[0] == identity


def test_int8_storage_of_a_cache_in_the_model_dtype_is_an_explicit_choice(tmp_path):
    batch = prompts(num_prefixes=5, per_prefix=2)
    eng = LLMEngine(EngineConfig(num_kv_blocks=14, max_num_seqs=2, max_model_len=256, num_threads=1,
                                 kv_host_cache_gib=0.01, kv_tier_storage="int8"))
    try:
        done = run(eng, batch)
        stats = tier_stats(eng)
    finally:
        eng.close()
    assert all(done[f"r{i}"][2] == {"host": 4 * BLOCK} for i in range(5, 10))
    # int8 values and bfloat16 scales: about a quarter of the float32 KV, plus each blob's header.
    assert stats["host"]["stored_bytes"] / stats["host"]["stored_blocks"] < 0.3 * FLOAT32_BLOCK_BYTES


def test_a_cache_in_the_model_dtype_is_stored_losslessly_by_default(tmp_path):
    """Default settings, float32 KV cache: a restart takes every prefix from the disk tier, with the
    outputs of a run without tiers, and the disk holds the float bytes compressed."""
    batch = prompts(num_prefixes=5, per_prefix=2, seed=7)

    def auto(**tiers):
        return LLMEngine(EngineConfig(num_kv_blocks=14, max_num_seqs=2, max_model_len=256, num_threads=1, **tiers))

    plain = auto()
    try:
        expected = run(plain, batch)
    finally:
        plain.close()
    first = auto(kv_disk_cache=str(tmp_path / "kv"))
    try:
        run(first, batch)
        assert first.kv_tiers.lossless
    finally:
        first.close()
    again = auto(kv_disk_cache=str(tmp_path / "kv"))
    try:
        done = run(again, batch)
        stats = tier_stats(again)
    finally:
        again.close()
    assert tokens(done) == tokens(expected)
    assert all(out[2] == {"disk": 4 * BLOCK} for out in done.values())
    files = list((tmp_path / "kv").iterdir())
    format_byte = 6  # after the magic, the version and the codec byte
    assert {f.read_bytes()[format_byte] for f in files} == {kv_codec.FLOAT32}
    # Compressed below the raw float32 bytes (the tiny model's random KV leaves little to take).
    assert stats["disk"]["stored_bytes"] / stats["disk"]["stored_blocks"] < FLOAT32_BLOCK_BYTES


def test_tier_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="need --prefix-cache"):
        EngineConfig(kv_host_cache_gib=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_disk_cache_gib"):
        EngineConfig(kv_disk_cache=str(tmp_path), kv_disk_cache_gib=-1.0)
    open_dir = Path(tmp_path / "open")
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ValueError, match="writable by every user"):
        engine(kv_disk_cache=str(open_dir))


def test_the_time_copying_a_prefix_up_is_billed_to_its_request():
    from mqinfer.workers.queue.costs import Meter, WorkModel
    from mqinfer.workers.engine.core import StepWork

    meter = Meter(WorkModel(1.0, 0.0, 0.0), start=0.0, device_share=0.5)
    work = [StepWork("loaded", 10, 100, True, 0, sampled=True, tier_load_s=0.3),
            StepWork("other", 10, 100, True, 0, sampled=True)]
    meter.step(1.0, work, {})
    loaded, other = meter.pop("loaded"), meter.pop("other")
    # Equal work shares the other 0.7 s; the 0.3 s of copying is the loaded request's; half a device.
    assert loaded.prefill_s == pytest.approx(0.5 * (0.3 + 0.35)) and other.prefill_s == pytest.approx(0.5 * 0.35)
    # Never more than the step: copying seconds beyond it are scaled down.
    meter.step(1.5, [StepWork("a", 1, 1, True, 0, tier_load_s=2.0), StepWork("b", 1, 1, True, 0)], {})
    assert meter.pop("a").prefill_s + meter.pop("b").prefill_s == pytest.approx(0.5 * 0.5)


def test_an_fp8_cache_is_kept_as_its_bytes(tmp_path):
    batch = prompts(num_prefixes=5, per_prefix=2, seed=4)

    def fp8(**tiers):
        return LLMEngine(EngineConfig(kv_cache_dtype="fp8", num_kv_blocks=14, max_num_seqs=2, max_model_len=256,
                                      num_threads=1, **tiers))

    plain, tiered = fp8(), fp8(kv_host_cache_gib=0.01)
    try:
        expected, done = run(plain, batch), run(tiered, batch)
    finally:
        plain.close()
        tiered.close()
    assert tokens(done) == tokens(expected)
    assert all(done[f"r{i}"][2] == {"host": 4 * BLOCK} for i in range(5, 10))
