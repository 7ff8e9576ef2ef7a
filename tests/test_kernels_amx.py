"""The AMX-INT8 path of the compiled ``quant_linear`` (``layers/matmul_kernels.cpp``) against its
vector path, bit for bit: Q4_0 and Q8_0 weights of several shapes (K of 896 and 4,864 blocks, N not
a multiple of 16, an odd number of 8-row groups), row counts around the AMX threshold and a
prompt-sized chunk, float32 and bfloat16 activations, with and without bias; and a row's bits
alone against the same row inside a 513-row call. ``SPLITSERVE_KERNELS_AMX=0`` puts a call on the
vector path. Also blocks of arbitrary bytes. Skipped where the CPU has no AMX-INT8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import kernels_built_for

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
TYPE_IDS = {"Q4_0": 2, "Q8_0": 8}


def cpu_has_amx_int8() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return "amx_int8" in flags and "amx_tile" in flags


pytestmark = pytest.mark.skipif(not cpu_has_amx_int8(), reason="this CPU has no AMX-INT8 (no amx_int8 flag)")


@pytest.fixture(scope="module")
def ops():
    """The kernels built for this CPU, with their AMX path available."""
    with kernels_built_for("native") as module:
        if module is None:
            pytest.skip("the compiled kernels cannot be built here (see the warning logged by layers/kernels.py)")
        assert module.quant_amx_available(), "an AMX-INT8 CPU whose native build has no usable AMX path"
        yield module


def packed_weight(ops, kind: str, N: int, K: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    raw = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), Q[kind])
    return ops.quant_pack(torch.from_numpy(np.ascontiguousarray(raw)), TYPE_IDS[kind], K)


def both_paths(ops, monkeypatch, x, packed, kind, N, bias):
    """(AMX path's output, vector path's output) of one call."""
    monkeypatch.delenv("SPLITSERVE_KERNELS_AMX", raising=False)
    amx = ops.quant_linear(x, packed, TYPE_IDS[kind], N, bias)
    monkeypatch.setenv("SPLITSERVE_KERNELS_AMX", "0")
    vector = ops.quant_linear(x, packed, TYPE_IDS[kind], N, bias)
    monkeypatch.delenv("SPLITSERVE_KERNELS_AMX")
    return amx, vector


@pytest.mark.parametrize("kind", list(TYPE_IDS))
@pytest.mark.parametrize("N,K", [(40, 896), (13, 64), (24, 4864), (150, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_amx_path_gives_the_vector_paths_bits(ops, monkeypatch, kind, N, K, dtype, with_bias):
    """Every output of M = 1, 15, 16, 17, 64 and 513 rows equal (torch.equal) on both paths."""
    packed = packed_weight(ops, kind, N, K, seed=N + K)
    g = torch.Generator().manual_seed(K)
    bias = torch.randn(N, generator=g) if with_bias else None
    for M in (1, 15, 16, 17, 64, 513):
        x = (torch.randn(M, K, generator=g) * 3).to(dtype)
        x[0, :32] = 0  # a block of zeros: d = 0
        amx, vector = both_paths(ops, monkeypatch, x, packed, kind, N, bias)
        assert amx.dtype == dtype and amx.shape == (M, N)
        assert torch.equal(amx, vector), f"{kind} [{N}, {K}] M={M} {dtype} bias={with_bias}"


@pytest.mark.parametrize("kind", list(TYPE_IDS))
def test_a_row_alone_equals_the_same_row_in_a_513_row_call(ops, kind):
    """Rows 0, 16, 300 and 512 of a 513-row call (AMX path) have the bits they have computed alone."""
    N, K = 72, 896
    packed = packed_weight(ops, kind, N, K, seed=7)
    x = torch.randn(513, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    chunk = ops.quant_linear(x, packed, TYPE_IDS[kind], N, None)
    for row in (0, 16, 300, 512):
        alone = ops.quant_linear(x[row:row + 1], packed, TYPE_IDS[kind], N, None)
        assert torch.equal(alone[0], chunk[row]), f"{kind} row {row}"


@pytest.mark.parametrize("kind", list(TYPE_IDS))
def test_any_block_bytes_give_the_same_bits(ops, monkeypatch, kind):
    """Blocks of random bytes (Q8_0 values of -128, which no quantizer writes; every nibble) on both paths."""
    N, K, bytes_per_block = 24, 256, {"Q4_0": 18, "Q8_0": 34}[kind]
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (N * K // 32, bytes_per_block), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(0.001, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    raw[:, 2:] = np.where(rng.random(raw[:, 2:].shape) < 0.2, 0x80, raw[:, 2:]).astype(np.uint8)
    packed = ops.quant_pack(torch.from_numpy(raw.reshape(N, -1)), TYPE_IDS[kind], K)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(1)) * 10
    amx, vector = both_paths(ops, monkeypatch, x, packed, kind, N, None)
    assert torch.equal(amx, vector)
