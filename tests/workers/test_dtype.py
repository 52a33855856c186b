"""`--dtype auto` picks the checkpoint's dtype, except on a CPU that cannot compute it natively."""

from __future__ import annotations

import torch

from mqinfer.workers.engine.loader import cpu_computes_natively, resolve_dtype

BF16 = {"torch_dtype": "bfloat16"}
AVX2 = frozenset({"avx", "avx2", "fma"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile", "avx512_fp16"})


def test_auto_on_a_cpu_without_native_half_precision_computes_in_float32():
    assert resolve_dtype("auto", BF16, "cpu", flags=AVX2) is torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, "cpu", flags=ZEN4) is torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, "cpu", flags=SAPPHIRE_RAPIDS) is torch.float16


def test_auto_keeps_the_checkpoint_dtype_where_it_is_native():
    assert resolve_dtype("auto", BF16, "cpu", flags=ZEN4) is torch.bfloat16
    assert resolve_dtype("auto", BF16, "cpu", flags=SAPPHIRE_RAPIDS) is torch.bfloat16
    assert resolve_dtype("auto", BF16, "cuda", flags=AVX2) is torch.bfloat16  # a GPU: the CPU's flags do not matter
    assert resolve_dtype("auto", {}, "cpu", flags=AVX2) is torch.float32


def test_an_explicit_dtype_is_kept():
    assert resolve_dtype("bfloat16", BF16, "cpu", flags=AVX2) is torch.bfloat16
    assert resolve_dtype(torch.bfloat16, None, "cpu", flags=AVX2) is torch.bfloat16


def test_native_check_reads_the_flags():
    assert not cpu_computes_natively(torch.bfloat16, AVX2)
    assert cpu_computes_natively(torch.bfloat16, ZEN4)
    assert cpu_computes_natively(torch.float32, frozenset())
