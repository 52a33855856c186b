"""Rotary position embeddings: the inverse frequencies (default, linear and Llama-3 scaling),
the cos/sin tables, and one step's rotary inputs shared by every layer.

The tables are float32 and cast to the activation dtype per token, as the reference
implementation does, so that greedy outputs agree token for token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mqinfer.workers.engine.models.config import ModelConfig, ModelLoadError

def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` (float32) with the configured scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    params = config.rope_scaling
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        try:
            factor = float(params["factor"])
            low = float(params["low_freq_factor"])
            high = float(params["high_freq_factor"])
            old_len = float(params["original_max_position_embeddings"])
        except KeyError as exc:
            raise ModelLoadError(f"llama3 rope scaling is missing {exc.args[0]!r}") from None
        # Long wavelengths (beyond the original context / low) are slowed by `factor`, short
        # ones (below original context / high) are kept, and the band between is blended.
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blend = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - blend) * slowed / factor + blend * slowed
        in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(in_band, smoothed, slowed)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``0..max_len-1`` (float32), looked up per packed token."""

    def __init__(self, config: ModelConfig, max_len: int, device) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(config).to(device)
        self.max_len = 0
        self.cos = self.sin = torch.empty(0)
        self.extend(max_len)

    def extend(self, max_len: int) -> None:
        if max_len <= self.max_len:
            return
        positions = torch.arange(max_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin, self.max_len = emb.cos(), emb.sin(), max_len

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos[:, None, :], sin[:, None, :]


class RotaryInputs:
    """One step's rotary inputs, shared by every layer: the float32 tables and the positions
    for the native kernel, and the per-token cos/sin (``[T, 1, D]`` in the activation dtype)
    that the PyTorch path needs, built on first use only."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self._per_token: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._per_token is None:
            self._per_token = self.rotary(self.positions, self.dtype)
        return self._per_token


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The second half of the last dimension negated and swapped with the first (the PyTorch path's rotation)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
