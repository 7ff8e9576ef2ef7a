"""The engine's fast paths against their references, on random data (no timings).

- The paged attention (``layers/attention.py``: batched decode through a block table, prefill from
  the start and later chunks) against a naive float64 attention of each sequence over its own
  keys, on random pages: GQA group sizes 1-4, lengths at and across page boundaries, shuffled page
  tables, mixed prefill + decode batches in any row order.
- The compiled ops (``layers/cpu_kernels.cpp`` through ``layers/ops.py``) against the PyTorch
  reference ops, float32 and bfloat16, and the whole engine with them against transformers; the
  compiled prefill attention and float32 matmul (``matmul_kernels.cpp``) against float64, and
  their batch invariance: a row's bits alone, in a batch, and in a prompt chunk of any size.
- Packed bf16 weights (``layers/linear.py``) against the dense ones.
- The fallback: a failed kernel build leaves the PyTorch ops in place.

The compiled ops are built once per machine into the cache (a few seconds of compiling); every
other test runs with them switched off (``SPLITSERVE_KERNELS=0``, set in conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.attention_reference import naive_attention
from helpers.compiled_ops import compiled  # noqa: F401 (a fixture)
from splitserve.layers import kernels
from splitserve.layers.attention import build_metadata, paged_attention
from splitserve.layers.linear import Linear, packing_available
from splitserve.layers.norm import RMSNorm
from splitserve.layers.ops import CompiledOps, TorchOps, best_ops

PAGE = 4
NUM_PAGES = 64


class RandomPool:
    """A 2-layer pool (the layout of ``engine/kv_pool.py``) with random contents and shuffled pages."""

    def __init__(self, Hkv: int, D: int, dtype=torch.float32, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.buffer = torch.randn(NUM_PAGES, 2, 2, PAGE, Hkv, D, generator=self.g).to(dtype)
        self.layer = self.buffer[:, 1]  # [pages, 2, P, Hkv, D], strided like a real layer view
        self.free = torch.randperm(NUM_PAGES, generator=self.g).tolist()

    def pages_for(self, n_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n_tokens // PAGE))]

    def keys_values(self, pages: list[int], kv_len: int):
        kv = self.layer[pages]  # [n, 2, P, Hkv, D]
        return (kv[:, 0].flatten(0, 1)[:kv_len], kv[:, 1].flatten(0, 1)[:kv_len])


def run_batch(pool: RandomPool, seqs, H: int, ops=None, dtype=torch.float32):
    """``seqs``: (start, q_len) per sequence. New k/v written like a layer does; returns
    (our output [T, H, D], per-sequence naive outputs)."""
    Hkv, D = pool.layer.shape[3], pool.layer.shape[4]
    described, pages_of = [], []
    for start, q_len in seqs:
        pages = pool.pages_for(start + q_len)
        pages_of.append(pages)
        described.append((start, q_len, pages))
    meta = build_metadata(described, PAGE, dtype=dtype)
    T = sum(n for _, n in seqs)
    q = torch.randn(T, H, D, generator=pool.g).to(dtype)
    new_kv = torch.randn(T, 2, Hkv, D, generator=pool.g).to(dtype)
    pool.layer[meta.slot_pages, :, meta.slot_offsets] = new_kv
    scale = D ** -0.5
    ops = ops or TorchOps()
    out = paged_attention(q, new_kv[:, 0], new_kv[:, 1], pool.layer, meta, scale, ops.decode_attention,
                          ops.prefill_attention)
    refs = []
    for (start, q_len), pages, s in zip(seqs, pages_of, meta.seqs):
        keys, values = pool.keys_values(pages, start + q_len)
        refs.append((s.q_start, naive_attention(q[s.q_start:s.q_start + q_len], keys, values,
                                                list(range(start, start + q_len)), scale)))
    return out, refs


def assert_matches(out, refs, tol):
    for q_start, ref in refs:
        got = out[q_start:q_start + ref.shape[0]].double()
        assert (got - ref).abs().max().item() < tol


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 3), (8, 2)])
def test_decode_rows_match_naive_attention_at_page_boundaries(H, Hkv):
    pool = RandomPool(Hkv, 16)
    lens = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE, 5 * PAGE + 2]  # kv_len after this step
    out, refs = run_batch(pool, [(n - 1, 1) for n in lens], H)
    assert_matches(out, refs, 1e-5)


def test_mixed_prefill_and_decode_rows_in_any_order():
    """Decode rows between prefill chunks (a prompt from its start, a later chunk that reads its
    first tokens back from the pages), so the decode rows are not rows 0..B-1."""
    pool = RandomPool(2, 16, seed=1)
    out, refs = run_batch(pool, [(6, 1), (0, 7), (9, 1), (5, 6), (0, 1)], 6)
    assert_matches(out, refs, 1e-5)


# -- the compiled ops -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(6, 3, 64), (8, 2, 32), (4, 4, 128)])  # D 32: the generic loops
def test_compiled_decode_attention_matches_the_reference(compiled, dtype, H, Hkv, D):
    pool = RandomPool(Hkv, D, dtype=dtype, seed=2)
    lens = [1, PAGE, PAGE + 1, 7 * PAGE + 3, 2]
    out, refs = run_batch(pool, [(n - 1, 1) for n in lens], H, ops=compiled, dtype=dtype)
    assert_matches(out, refs, 1e-5 if dtype == torch.float32 else 2e-2)
    pool = RandomPool(Hkv, D, dtype=dtype, seed=3)  # also inside a mixed batch
    out, refs = run_batch(pool, [(0, 5), (6, 1), (3, 1)], H, ops=compiled, dtype=dtype)
    assert_matches(out, refs, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(6, 3, 64), (4, 4, 20)])  # D 20: no whole vectors
def test_compiled_prefill_attention_matches_naive_attention(compiled, dtype, H, Hkv, D):
    """Prompts from their start and later chunks (reading earlier keys back from the pages), at
    and across page boundaries, beside decode rows."""
    pool = RandomPool(Hkv, D, dtype=dtype, seed=9)
    out, refs = run_batch(pool, [(0, 7), (5, 1), (4, 9), (0, PAGE), (PAGE, 2 * PAGE + 1)], H, ops=compiled, dtype=dtype)
    assert_matches(out, refs, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 128), (2, 1, 256)])  # prompt rows two at a time; D 256: one
def test_compiled_attention_of_a_row_is_the_same_alone_in_a_chunk_or_decoding(compiled, dtype, H, Hkv, D):
    """Batch invariance: a row at position p gives the same bits as a decode row (kv_len p + 1),
    in a prompt's one chunk, or in a later chunk starting anywhere before it."""
    n = 3 * PAGE + 2
    pool = RandomPool(Hkv, D, dtype=dtype, seed=10)
    pages = torch.tensor(pool.pages_for(n))
    q = torch.randn(n, H, D, generator=pool.g).to(dtype)
    whole = compiled.k.prefill_attention(q, pool.layer, pages, 0, 0.125)
    for start in (1, PAGE - 1, PAGE, n - 2):
        assert torch.equal(compiled.k.prefill_attention(q[start:], pool.layer, pages, start, 0.125), whole[start:])
    for p in range(n):
        alone = compiled.k.decode_attention(q[p:p + 1], pool.layer, pages[None], torch.tensor([p + 1]), 0.125)
        assert torch.equal(alone[0], whole[p]), p
    batch = compiled.k.decode_attention(q, pool.layer, pages[None].expand(n, -1), torch.arange(1, n + 1), 0.125)
    assert torch.equal(batch, whole)


def test_compiled_decode_attention_reads_q_through_a_strided_view(compiled):
    pool = RandomPool(2, 32, seed=4)
    meta = build_metadata([(8, 1, pool.pages_for(9)), (2, 1, pool.pages_for(3))], PAGE)
    qkv = torch.randn(2, (6 + 2 * 2) * 32)
    q = qkv[:, :6 * 32].view(2, 6, 32)  # rows 320 apart, as the model hands it over
    ref = TorchOps().decode_attention(q.contiguous(), pool.layer, meta, 0.2)
    assert torch.allclose(compiled.decode_attention(q, pool.layer, meta, 0.2), ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_norm_and_rope_match_the_reference(compiled, dtype):
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    residual = torch.randn(5, 96, generator=g).to(dtype)
    x = torch.randn(5, 2 * 96, generator=g).to(dtype)[:, :96]  # strided rows
    ref_out, ref_res = TorchOps().add_rms_norm(x, residual.clone(), norm)
    ours_res = residual.clone()
    ours_out, same = compiled.add_rms_norm(x, ours_res, norm)
    assert same is ours_res and torch.equal(ours_res, ref_res)  # the add rounds like the reference
    assert (ours_out.float() - ref_out.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 1.6e-2)
    norm_only = compiled.add_rms_norm(None, residual.clone(), norm)[0]
    assert torch.equal(norm_only, TorchOps().add_rms_norm(None, residual, norm)[0])

    H, Hkv, D, T = 4, 2, 16, 6
    pool_ref, pool_ours = RandomPool(Hkv, D, dtype=dtype, seed=6), RandomPool(Hkv, D, dtype=dtype, seed=6)
    described = [(0, 4, pool_ref.pages_for(4)), (9, 1, pool_ref.pages_for(10)), (3, 1, pool_ref.pages_for(4))]
    meta = build_metadata(described, PAGE, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 3, 9, 3])
    angles = positions.float()[:, None] * (1e4 ** (-torch.arange(0, D, 2).float() / D))[None, :]
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype) * 3
    ours, ref = qkv.clone(), qkv.clone()
    TorchOps().rope_store(ref, TorchOps().rope_tables(angles.cos(), angles.sin(), dtype), H, Hkv, pool_ref.layer, meta)
    compiled.rope_store(ours, compiled.rope_tables(angles.cos(), angles.sin(), dtype), H, Hkv, pool_ours.layer, meta)
    tol = 1e-5 if dtype == torch.float32 else 6e-2  # bf16: one rounding vs the reference's three
    assert (ours.float() - ref.float()).abs().max() <= tol
    assert (pool_ours.buffer.float() - pool_ref.buffer.float()).abs().max() <= tol
    assert torch.equal(pool_ours.buffer[:, 0], pool_ref.buffer[:, 0])  # the other layer untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_silu_mul_matches_the_reference(compiled, dtype):
    g = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(7, 2 * 3 * 40, generator=g) * 4).to(dtype)[:, :2 * 40]  # strided rows
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(dtype)  # exp clamped, both ends
    ref = TorchOps().silu_mul(gate_up).float()
    ours = compiled.silu_mul(gate_up).float()
    assert ours.shape == (7, 40)
    assert ((ours - ref).abs() <= (1e-6 if dtype == torch.float32 else 8e-3) * (1 + ref.abs())).all()


def test_engine_with_compiled_ops_matches_transformers(compiled, monkeypatch):
    from helpers.hf_greedy import hf_greedy
    from helpers.prompts import prompts

    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.io import GenerateRequest, SamplingParams
    from splitserve.testing.tiny import tiny_model_path

    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    model = str(tiny_model_path(arch="qwen3"))  # GQA 8/4, q/k norm, head_dim 64
    engine = LLMEngine(EngineConfig(model=model, page_size=16, max_total_tokens=4096))
    assert engine.runner.model.ops.name == "compiled" and engine.spec.dtype == torch.float32
    reqs = [GenerateRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=20))
            for i, p in enumerate(prompts(engine.spec.vocab_size, lengths=[3, 17, 50]))]
    outs = engine.generate(reqs)
    for r in reqs:
        assert list(outs[r.rid].token_ids) == hf_greedy(model, list(r.prompt_ids), 20), r.rid


@pytest.mark.parametrize("N,K", [(50, 64), (7, 37), (130, 200)])
def test_compiled_float32_linear_matches_and_is_batch_invariant(compiled, N, K):
    """linear_f32 against float64, and each row the same bits alone and in batches of any size
    (K 37 and 200: a tail of K % 8; N 7, 50, 130: partial tiles and blocks; a strided x and w)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(N, 2 * K, generator=g)[:, :K]
    bias = torch.randn(N, generator=g)
    x = torch.randn(23, 3 * K, generator=g)[:, K:2 * K]
    y = compiled.linear(x, w, bias)
    ref = x.double() @ w.double().T + bias.double()
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for m in (1, 2, 3, 5, 16):
        for at in (0, 23 - m):
            assert torch.equal(compiled.linear(x[at:at + m], w, bias), y[at:at + m]), (m, at)
    assert (compiled.linear(x, w, None).double() - (ref - bias.double())).abs().max() <= 1e-5 * ref.abs().max()


def test_loading_the_kernels_twice_builds_them_once(compiled):
    """cpp_extension.load appends its libraries to the flags it is given: they once went into the
    next build name, so every later load in a process built the kernels again."""
    name = kernels.build_name()
    assert kernels.load(force=True) is compiled.k
    assert kernels.build_name() == name


def test_a_failed_build_falls_back_to_the_torch_ops(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    assert kernels.load() is None
    assert "c++: command not found" in caplog.text
    assert isinstance(best_ops("cpu", torch.float32), TorchOps)
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert kernels.load() is None and not isinstance(best_ops(), CompiledOps)


# -- packed weights --------------------------------------------------------------------------------


@pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"), reason="oneDNN bf16 packing unavailable")
def test_packed_bf16_linear_equals_the_dense_one():
    g = torch.Generator().manual_seed(7)
    layer = Linear(96, 80, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g) / math.sqrt(96))
        layer.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(300, 96, generator=g).to(torch.bfloat16)
    dense = [F.linear(x[:m], layer.weight, layer.bias) for m in (1, 16, 300)]
    layer.pack()
    assert layer.weight.numel() == 0  # the dense copy is released
    for m, ref in zip((1, 16, 300), dense):
        assert torch.allclose(layer(x[:m]).float(), ref.float(), atol=2e-2, rtol=1e-2), m


@pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"), reason="oneDNN bf16 packing unavailable")
@pytest.mark.parametrize("family,tied", [("Llama", True), ("Qwen2", False)])
def test_a_packed_model_gives_the_dense_models_logits(tmp_path, family, tied):
    from helpers.checkpoints import make_checkpoint
    from helpers.paged_sequences import PagedSequences

    from splitserve.models.loader import load_model

    make_checkpoint(tmp_path, family, dict(tie_word_embeddings=tied), {})
    model, spec = load_model(tmp_path, dtype="bfloat16")
    prompt = list(range(3, 40))

    def logits():
        seqs = PagedSequences(spec)
        s = seqs.add(prompt + [7])
        with torch.inference_mode():
            ids, pos, meta = seqs.step([(s, len(prompt))])
            prefill = model.compute_logits(model(ids, pos, meta, seqs.kv))
            ids, pos, meta = seqs.step([(s, 1)])
            return prefill, model.compute_logits(model(ids, pos, meta, seqs.kv))

    dense = logits()
    assert model.pack_weights() == 4 * spec.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    for ours, ref in zip(logits(), dense):
        assert (ours - ref).abs().max() <= 0.02 * ref.std()


# -- batch invariance of the whole model -----------------------------------------------------------


def last_logits(model, seqs, work, s) -> torch.Tensor:
    """One step of ``work`` (a ``PagedSequences``); the logits of sequence ``s``'s last new
    token, computed with the step's other sampling rows as the engine does (one head call)."""
    ids, positions, meta = seqs.step(work)
    with torch.inference_mode():
        hidden = model(ids, positions, meta, seqs.kv)
        rows = torch.tensor([m.q_start + m.q_len - 1 for m in meta.seqs])
        logits = model.compute_logits(hidden[rows])
    return logits[[w[0] for w in work].index(s)]


def paged_sequences(spec, num_pages: int, kv_cache_dtype: str = "auto"):
    """A ``PagedSequences`` over a pool of ``kv_cache_dtype`` pages."""
    import dataclasses

    from helpers.paged_sequences import PagedSequences

    from splitserve.engine.kv_pool import KVPool

    seqs = PagedSequences(spec, num_pages=num_pages)
    if kv_cache_dtype != "auto":
        seqs.kv = KVPool(dataclasses.replace(seqs.kv.layout, kv_cache_dtype=kv_cache_dtype))
    return seqs


def logits_every_way(model, spec, prompt: list[int], kv_cache_dtype: str = "auto") -> dict[str, torch.Tensor]:
    """The last prompt token's logits: the prompt in one chunk, in chunks of several sizes, the
    token decoded alone after the rest, in a decode batch of 16 and beside another prompt's chunk."""
    from helpers.paged_sequences import run_step

    n, out = len(prompt), {}
    for chunks in ([n], [16, 16, n - 32], [1, n - 1], [n - 1, 1], [5] * (n // 5) + [n % 5]):
        seqs = paged_sequences(spec, 64, kv_cache_dtype)
        s = seqs.add(prompt)
        for size in chunks[:-1]:
            run_step(model, seqs, [(s, size)])
        out[f"chunks {chunks}"] = last_logits(model, seqs, [(s, chunks[-1])], s)
    seqs = paged_sequences(spec, 256, kv_cache_dtype)
    others = [seqs.add([(7 * i + j) % 500 + 3 for j in range(3 + i)]) for i in range(15)]
    s = seqs.add(prompt)
    run_step(model, seqs, [(o, len(seqs.tokens[o])) for o in others] + [(s, n - 1)])
    for o in others:
        seqs.tokens[o].append(11)
    out["in a decode batch of 16"] = last_logits(model, seqs, [(o, 1) for o in others[:7]] + [(s, 1)]
                                                 + [(o, 1) for o in others[7:]], s)
    seqs = paged_sequences(spec, 64, kv_cache_dtype)
    s = seqs.add(prompt)
    run_step(model, seqs, [(s, n - 1)])
    late = seqs.add(prompt[::-1] * 2)
    out["beside a prompt chunk"] = last_logits(model, seqs, [(late, 2 * n), (s, 1)], s)
    return out


@pytest.mark.parametrize("quantization,kv_cache_dtype", [("none", "auto"), ("int8", "auto"), ("int4", "auto"),
                                                          ("none", "int8")])
def test_a_row_computed_alone_and_in_a_chunk_gives_the_same_logits(compiled, quantization, kv_cache_dtype,
                                                                     monkeypatch):
    """Batch invariance, which the token-identical recompute of a lost transfer relies on: with
    the compiled kernels a prompt's last token gets the same logits, bit for bit, however the
    prompt is chunked and whatever else shares its steps: its own chunk, decoded alone, in a
    decode batch of 16, beside another prompt. On the tiny model in float32 (dense weights through
    linear_f32) and with its weights quantized at load (int8: Q8_0; int4: Q4_1, embedding and
    head Q8_0); and over int8 KV pages (``--kv-cache-dtype int8``: the rows quantized as they are
    stored, read as they are).
    (The PyTorch ops do not promise it: BLAS and SDPA add in orders that follow the batch; the
    last test below states by how much.)"""
    from splitserve.models.loader import load_model
    from splitserve.testing.tiny import tiny_model_path

    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    model, spec = load_model(tiny_model_path(), dtype="float32", quantization=quantization)
    assert model.set_ops(compiled) == (4 * spec.num_layers + 1 if quantization == "none" else 0)  # + the head
    assert spec.quantization == {"none": "none", "int8": "Q8_0:30", "int4": "Q4_1:28,Q8_0:2"}[quantization]
    ways = logits_every_way(model, spec, [(5 * i) % 400 + 3 for i in range(37)], kv_cache_dtype)
    first = ways.pop("chunks [37]")
    for way, logits in ways.items():
        assert torch.equal(logits, first), f"{way}: max |dlogit| {(logits - first).abs().max():.3g}"


def test_the_pytorch_ops_differ_by_rounding_only():
    """Without the compiled kernels (SPLITSERVE_KERNELS=0: the PyTorch reference ops, BLAS's sgemm
    and SDPA) the same logits agree to float32 rounding, not to the bit: here within 1e-5 of the
    logits' scale (measured ~1e-6)."""
    from splitserve.models.loader import load_model
    from splitserve.testing.tiny import tiny_model_path

    model, spec = load_model(tiny_model_path(), dtype="float32", quantization="none")
    ways = logits_every_way(model, spec, [(5 * i) % 400 + 3 for i in range(37)])
    first = ways.pop("chunks [37]")
    worst = max((logits - first).abs().max().item() for logits in ways.values())
    print(f"\nPyTorch ops: max |dlogit| {worst:.3g} (logits std {first.std():.3g})")
    assert worst <= 1e-5 * first.std().item()
