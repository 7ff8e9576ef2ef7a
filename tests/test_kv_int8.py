"""The 8-bit KV cache (``--kv-cache-dtype int8``: ``layers/kv_int8.py``, ``engine/kv_pool.py``).

- Rows: the quantize / dequantize round trip is within half a step of each value, zero rows stay
  zero, and the same input gives the same bytes.
- The pool: the same memory holds about twice the pages of a bfloat16 pool; a page is one span.
- Attention over int8 pages: the PyTorch path against a float64 attention over the pages' values;
  the compiled kernels against the PyTorch path; the kernels' row invariance on int8 pages (a row
  alone, in a prompt chunk and decoding: the same bits); the kernels' ``rope_store`` writes the
  bytes ``kv_int8.quantize`` writes. (The whole model's row invariance with int8 pages is
  ``test_kernels.py::test_a_row_computed_alone_and_in_a_chunk_gives_the_same_logits``.)
- Agreement: the fingerprint, the handshake and the discovery record name the KV cache dtype; a
  mismatch is named first.
- Real processes: a prefill and a decode worker both int8 give the tokens the decode worker gives
  serving the request alone (as a colocated worker: ``test_decode_alone.py``); a decode worker of
  the model's dtype refuses an int8 prefill, naming ``kv_cache_dtype``.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import requests
import torch

from helpers.attention_reference import naive_attention
from helpers.client_text import assert_in_words, logged_ending
from helpers.compiled_ops import compiled  # noqa: F401 (a fixture)
from splitserve.disagg.bootstrap import first_mismatch, local_info, model_identity
from splitserve.discovery.record import WorkerRecord, parse_record
from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.layers import kv_int8
from splitserve.layers.attention import build_metadata, paged_attention
from splitserve.layers.ops import TorchOps

PAGE = 4
NUM_PAGES = 48


# -- rows ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_round_trip_is_within_half_a_step_and_the_same_bytes_each_time(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10).to(dtype)
    x[0, 0] = 0  # an all-zero row: scale 0, values 0
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + kv_int8.SCALE_BYTES)
    scale = kv_int8.scales(rows)
    assert torch.equal(scale, x.float().abs().amax(-1, keepdim=True) / 127)
    back = kv_int8.dequantize(rows, torch.float32)
    assert ((back - x.float()).abs() <= scale * (0.5 + 2e-5)).all()  # half a step, and q * scale's rounding
    assert torch.equal(back[0, 0], torch.zeros(64)) and (rows[..., :64] != -128).all()
    assert torch.equal(kv_int8.quantize(x.clone()), rows)  # deterministic: a recompute writes these bytes
    assert kv_int8.dequantize(rows, dtype).dtype == dtype


def test_an_int8_pool_holds_about_twice_the_tokens_of_a_bfloat16_pool_in_the_same_memory():
    """SmolLM2's shape (30 layers, 3 KV heads, head dim 64): a page of int8 rows is 68/128 of a
    bfloat16 page, so a budget of bytes holds 1.88x the pages; the buffer is those pages, one span each."""
    shape = dict(num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    bf16, int8 = KVLayout(num_pages=1, **shape), KVLayout(num_pages=1, kv_cache_dtype="int8", **shape)
    assert int8.page_nbytes * 128 == bf16.page_nbytes * 68
    budget = 1 << 30
    pages = {name: budget // layout.page_nbytes for name, layout in (("bf16", bf16), ("int8", int8))}
    assert pages["int8"] >= 1.88 * pages["bf16"]
    pool = KVPool(dataclasses.replace(int8, num_pages=5))
    assert pool.nbytes == 5 * int8.page_nbytes and pool.buffer.is_contiguous()
    assert pool.page_bytes(3).numel() == int8.page_nbytes and pool.page_offset(3) == 3 * int8.page_nbytes
    assert pool.layer(0).shape == (5, 2, 16, 3, 64 + kv_int8.SCALE_BYTES)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVLayout(num_pages=1, kv_cache_dtype="fp8", **shape)


# -- attention over int8 pages ---------------------------------------------------------------------


class Int8Pool:
    """A 2-layer int8 pool with random rows (``test_kernels.RandomPool``'s layout) and shuffled pages."""

    def __init__(self, Hkv: int, D: int, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        values = torch.randn(NUM_PAGES, 2, 2, PAGE, Hkv, D, generator=self.g) * 2
        self.buffer = kv_int8.quantize(values)
        self.layer = self.buffer[:, 1]  # [pages, 2, P, Hkv, D + 4], strided like a real layer view
        self.free = torch.randperm(NUM_PAGES, generator=self.g).tolist()

    def pages_for(self, n_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n_tokens // PAGE))]


def run_int8_batch(pool: Int8Pool, seqs, H: int, ops, dtype=torch.float32, seed: int = 1):
    """``seqs``: (start, q_len) per sequence; the new rows quantized into the pool as a layer does.
    Returns the attention's output [T, H, D] and the float64 reference over the pages' values."""
    Hkv, D = pool.layer.shape[3], kv_int8.head_dim_of(pool.layer)
    g = torch.Generator().manual_seed(seed)
    described = [(start, q_len, pool.pages_for(start + q_len)) for start, q_len in seqs]
    meta = build_metadata(described, PAGE, dtype=dtype)
    T = sum(n for _, n in seqs)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    new_kv = torch.randn(T, 2, Hkv, D, generator=g).to(dtype)
    pool.layer[meta.slot_pages, :, meta.slot_offsets] = kv_int8.quantize(new_kv)
    out = paged_attention(q, new_kv[:, 0], new_kv[:, 1], pool.layer, meta, D ** -0.5, ops.decode_attention,
                          ops.prefill_attention)
    refs = []
    for (start, q_len), (_, _, pages), s in zip(seqs, described, meta.seqs):
        kv = kv_int8.dequantize(pool.layer[pages], torch.float64)  # [n, 2, P, Hkv, D]
        keys, values = kv[:, 0].flatten(0, 1)[:start + q_len], kv[:, 1].flatten(0, 1)[:start + q_len]
        refs.append(naive_attention(q[s.q_start:s.q_start + q_len], keys, values,
                                    list(range(start, start + q_len)), D ** -0.5))
    return out, torch.cat(refs)


MIXED = [(0, 7), (5, 1), (4, 9), (0, 1), (PAGE, 2 * PAGE + 1), (3 * PAGE - 1, 1)]  # prompts, chunks, decode rows


def test_the_pytorch_attention_reads_int8_pages_as_their_values():
    out, ref = run_int8_batch(Int8Pool(3, 32), MIXED, 6, TorchOps())
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(6, 3, 64), (4, 2, 20)])  # D 20: the generic loops
def test_the_compiled_attention_on_int8_pages_agrees_with_the_pytorch_path(compiled, dtype, H, Hkv, D):
    ours, ref = run_int8_batch(Int8Pool(Hkv, D, seed=2), MIXED, H, compiled, dtype)
    torch_out, _ = run_int8_batch(Int8Pool(Hkv, D, seed=2), MIXED, H, TorchOps(), dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ours.double() - ref).abs().max() < tol
    assert (ours.float() - torch_out.float()).abs().max() < 2 * tol


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 128), (2, 1, 256), (4, 2, 20)])
def test_the_compiled_attention_of_a_row_on_int8_pages_is_the_same_alone_in_a_chunk_or_decoding(compiled, H, Hkv, D):
    n = 3 * PAGE + 2
    pool = Int8Pool(Hkv, D, seed=10)
    pages = torch.tensor(pool.pages_for(n))
    q = torch.randn(n, H, D, generator=pool.g)
    whole = compiled.k.prefill_attention(q, pool.layer, pages, 0, 0.125)
    for start in (1, PAGE - 1, PAGE, n - 2):
        assert torch.equal(compiled.k.prefill_attention(q[start:], pool.layer, pages, start, 0.125), whole[start:])
    for p in range(n):
        alone = compiled.k.decode_attention(q[p:p + 1], pool.layer, pages[None], torch.tensor([p + 1]), 0.125)
        assert torch.equal(alone[0], whole[p]), p
    batch = compiled.k.decode_attention(q, pool.layer, pages[None].expand(n, -1), torch.arange(1, n + 1), 0.125)
    assert torch.equal(batch, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_rope_store_writes_the_rows_quantize_writes(compiled, dtype):
    """With the rotation the identity (cos 1, sin 0) both paths store the same k and v: the bytes
    of every written row are equal (the same quantization, operation for operation)."""
    H, Hkv, D, T = 4, 2, 64, 6
    g = torch.Generator().manual_seed(5)
    pools = [KVPool(KVLayout(NUM_PAGES, 1, PAGE, Hkv, D, dtype, kv_cache_dtype="int8")) for _ in range(2)]
    meta = build_metadata([(0, 4, [7, 3]), (9, 1, [1, 2, 5]), (3, 1, [9])], PAGE, dtype=dtype)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3).to(dtype)
    qkv[2, (H + 1) * D:(H + 2) * D] = 0  # a zero row of k
    cos, sin = torch.ones(T, D // 2), torch.zeros(T, D // 2)
    for ops, pool in zip((TorchOps(), compiled), pools):
        ops.rope_store(qkv.clone(), ops.rope_tables(cos, sin, dtype), H, Hkv, pool.layer(0), meta)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert pools[1].buffer.count_nonzero() > 0


# -- agreement between workers ---------------------------------------------------------------------


def test_the_fingerprint_handshake_and_record_name_the_kv_cache_dtype(tmp_path):
    spec = type("Spec", (), {"path": str(tmp_path), "architecture": "LlamaForCausalLM", "quantization": "none"})()
    layout = KVLayout(num_pages=4, num_layers=2, page_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    int8 = dataclasses.replace(layout, kv_cache_dtype="int8")
    ours, theirs = local_info(spec, int8, "nixl", "a"), local_info(spec, layout, "nixl", "b")
    assert ours.model == model_identity(spec, kv_cache_dtype="int8") == model_identity(spec) + "/kv-int8"
    assert ours.dtype == "int8/bfloat16" and theirs.dtype == "bfloat16"
    assert first_mismatch(ours, theirs).startswith("kv_cache_dtype (ours int8, peer's auto)")
    assert first_mismatch(ours, local_info(spec, int8, "nixl", "c")) is None
    record = WorkerRecord("d-0", "abc", "decode", "http://10.0.0.1:8000", None, ours.model, 1, "nixl")
    assert record.kv_cache_dtype == "int8" and b'"kv_cache_dtype":"int8"' in record.to_json()
    assert parse_record(record.to_json()) == record
    plain = WorkerRecord("d-0", "abc", "decode", "http://10.0.0.1:8000", None, theirs.model, 1, "nixl")
    assert b"kv_cache_dtype" not in plain.to_json() and parse_record(plain.to_json()).kv_cache_dtype == "auto"
    for wrong, says in (({"kv_cache_dtype": "auto"}, "fingerprint names int8"), ({"kv_cache_dtype": "fp4"}, "fp4")):
        body = {**dataclasses.asdict(record), **wrong}
        with pytest.raises(ValueError, match=says):
            parse_record(body)


# -- real processes --------------------------------------------------------------------------------

INT8 = ["--kv-cache-dtype", "int8"]
SHARED = ["--page-size", "16", "--max-total-tokens", "2048", "--no-prefix-cache"]  # every prompt page crosses


@pytest.fixture(scope="module")
def workers():
    """An int8 prefill, an int8 decode and a decode of the model's dtype."""
    from cluster import Cluster

    with Cluster(1, 2, "nixl", router=False, worker_args=SHARED, prefill_args=[INT8], decode_args=[INT8, []]) as c:
        yield c


def split(prefill, decode, ids: list[int], new_tokens: int) -> tuple[requests.Response, dict]:
    """One request sent to a prefill and a decode worker with one room, as the router sends it."""
    from cluster import post_generate

    room = random.getrandbits(63)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room,
             "rid": f"int8-{room}"}
    answers: dict = {}

    def post(name, worker):
        try:
            answers[name] = post_generate(worker.url, ids, new_tokens, extra=extra, ignore_eos=True, timeout=120,
                                          temperature=0)
        except requests.RequestException as exc:
            answers[name] = exc
    threads = [threading.Thread(target=post, args=pair, daemon=True) for pair in (("prefill", prefill),
                                                                                   ("decode", decode))]
    for t in threads:
        t.start()
    threads[1].join(120)
    return answers.get("decode"), answers


def test_an_int8_pair_gives_the_tokens_of_the_int8_decode_worker_alone(workers):
    """And the prompt's pages cross as they are: the prefill wrote its 5 pages of int8 rows (9,216
    bytes each for the tiny model, a float32 page being 32,768)."""
    from cluster import generate, metric, metrics, pages_back_to_total

    cluster = workers
    ids = [random.Random(1).randint(10, 2000) for _ in range(70)]
    written = metric(metrics(cluster.prefill[0]), "splitserve_kv_transfer_bytes_total", role="prefill")
    resp, _ = split(cluster.prefill[0], cluster.decode[0], ids, 12)
    assert isinstance(resp, requests.Response) and resp.status_code == 200, resp
    want = generate(cluster.decode[0].url, ids, 12, ignore_eos=True, temperature=0)  # no bootstrap: colocated
    assert resp.json()["output_ids"] == want
    page = KVLayout(1, 4, 16, 2, 32, torch.float32, kv_cache_dtype="int8").page_nbytes
    assert page == 9216
    assert metric(metrics(cluster.prefill[0]), "splitserve_kv_transfer_bytes_total", role="prefill") - written \
        == 5 * page
    pages_back_to_total(cluster.decode[0])


def test_a_decode_worker_of_another_kv_cache_dtype_refuses_the_int8_prefill(workers):
    from cluster import pages_back_to_total

    cluster = workers
    resp, _ = split(cluster.prefill[0], cluster.decode[1], list(range(10, 50)), 4)
    assert isinstance(resp, requests.Response) and 500 <= resp.status_code < 600, resp
    assert_in_words(resp.json()["error"], "incompatible_peer", cluster.prefill[0].bootstrap_port)
    line = logged_ending(cluster.decode[1], resp.headers["X-Request-Id"], "incompatible_peer")  # the client reads words
    assert "kv_cache_dtype (ours auto, peer's int8)" in line and "--kv-cache-dtype" in line, line
    pages_back_to_total(cluster.decode[1])


@pytest.mark.parametrize("value", ["INT8", "fp8", ""])
def test_a_cache_dtype_it_does_not_know_exits_2_before_the_model_loads(value):
    """One line naming the flag and the choices, exit 2, no traceback: checked with the other
    flags, not when the pool is built after the model loaded."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", "tiny", "--port", "1",
                           "--kv-cache-dtype", value], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--kv-cache-dtype must be one of auto, int8" in done.stderr and "Traceback" not in done.stderr
