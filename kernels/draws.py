"""Seeded random draws for sampling: a counter-based hash (splitmix64 on int64 tensors) and the
Gumbel noise made from it.

Row ``b`` of a batch is keyed by its request's seed and the position of the token being
sampled (``row_keys``); column ``i`` of that row draws 23 bits from the hash of the key and
``i`` (``draw_bits``). The bits become a uniform in (0, 1) (``uniforms_of_draws``) and the
uniform Gumbel noise (``gumbel_noise``). Every value is a pure function of (seed, position,
index), so the same seed gives the same draws whatever the batch.

The native Gumbel-max kernel (``cpu_ops.gumbel_argmax``) hashes in C with the same arithmetic
and takes its noise from a table that ``gumbel_noise`` fills, so both give the same tokens.
"""

from __future__ import annotations

import torch

# Random bits per draw: ``(bits + 0.5) / 2**DRAW_BITS`` is exact in float32 and never 0 or 1.
DRAW_BITS = 23


def _signed64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; mask the sign-extended bits to get a logical shift.
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The 64-bit key of each row (as int64), ``[B]``, from its seed and the position sampled."""
    return mix64(mix64(seeds.to(torch.int64) + _GOLDEN) ^ mix64(positions.to(torch.int64)))


def draw_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, vocab_size]`` int64 in [0, 2**DRAW_BITS): the top bits of
    ``mix64(key + (i + 1) * golden)`` for column i."""
    counter = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _GOLDEN
    return _shr(mix64(keys[:, None] + counter[None, :]), 64 - DRAW_BITS)


def uniforms_of_draws(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1): ``(bits + 0.5) / 2**DRAW_BITS``."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << DRAW_BITS))


def gumbel_noise(uniforms: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` (float32, as PyTorch's ``log`` rounds it)."""
    return -torch.log(-torch.log(uniforms))


__all__ = ["DRAW_BITS", "draw_bits", "gumbel_noise", "mix64", "row_keys", "uniforms_of_draws"]
