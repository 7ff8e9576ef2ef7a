"""The models against transformers, through the paged KV pool, and the loader's errors.

Each case saves a tiny random checkpoint with transformers' own classes, loads it with
``load_model`` and compares log-probabilities with transformers' forward over the same tokens, at
prefill and at every decode step. Tolerance: max |Δ log-prob| <= 1e-4 * std(reference logits)
(float32; the observed differences are around 1e-6 of that scale).

KV pages are 4 tokens and are handed out from a shuffled free list, so sequences cross page
boundaries and their page tables are not contiguous.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.checkpoints import VOCAB, make_checkpoint
from helpers.paged_sequences import PagedSequences, run_step
from splitserve.models.loader import load_model, load_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (transformers family, config overrides, save options)
CASES = {
    "llama": ("Llama", dict(rms_norm_eps=1e-5), {}),
    # rope llama3; config.json rewritten to the transformers-4 spelling (rope_scaling + rope_theta)
    "llama3-rope": ("Llama", dict(rope_theta=50000.0, rope_scaling=LLAMA3_ROPE), {"v4_rope_spelling": True}),
    "llama-tied-sharded": ("Llama", dict(tie_word_embeddings=True), {"max_shard_size": "60KB"}),
    # Mistral-style Llama: explicit head_dim (4 * 32 != hidden 64), large theta
    "llama-head-dim": ("Llama", dict(head_dim=32, rope_theta=1e6), {}),
    "qwen2": ("Qwen2", dict(rope_theta=1e6), {}),
    "qwen3": ("Qwen3", dict(head_dim=32, rope_theta=1e6, num_hidden_layers=3), {"max_shard_size": "100KB"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, overrides, save = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, family, overrides, save)
    if "max_shard_size" in save:
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    model, spec = load_model(path, dtype="float32")  # auto would pick bfloat16 on a bf16 CPU
    return hf, model, spec


# -- the reference and the tolerance ----------------------------------------------------------------


@torch.inference_mode()
def reference(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), vocab] for one sequence, no cache."""
    return hf(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref_logits: torch.Tensor, what: str) -> float:
    diff = (ours - F.log_softmax(ref_logits, dim=-1)).abs().max().item()
    tol = 1e-4 * ref_logits.std().item()
    assert diff <= tol, f"{what}: max |dlogprob| {diff:.3g} > {tol:.3g}"
    return diff


# -- numerics against transformers -----------------------------------------------------------------


def test_spec_matches_config(case):
    hf, model, spec = case
    c = hf.config
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size, spec.vocab_size,
            spec.max_context) == (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                  getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                                  c.hidden_size, c.vocab_size, c.max_position_embeddings)
    assert spec.tie_word_embeddings == c.tie_word_embeddings and spec.dtype == torch.float32
    assert spec.architecture == type(hf).__name__


def test_prefill_and_greedy_decode_match_transformers(case):
    hf, model, spec = case
    seqs = PagedSequences(spec)
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    s = seqs.add(prompt)
    (lp,) = run_step(model, seqs, [(s, len(prompt))])  # prefill crosses a page boundary (7 > 4)
    assert_close(lp, reference(hf, prompt), "prefill")
    for step in range(6):  # greedy continuation, one token per step, up to 13 tokens (4 pages)
        ref = reference(hf, seqs.tokens[s])[-1:]
        nxt = int(lp[-1].argmax())
        assert nxt == int(ref.argmax())
        seqs.tokens[s].append(nxt)
        (lp,) = run_step(model, seqs, [(s, 1)])
        assert_close(lp, reference(hf, seqs.tokens[s])[-1:], f"decode step {step}")
    assert any(b != a + 1 for a, b in zip(seqs.pages[s], seqs.pages[s][1:]))


def test_batched_mixed_prefill_and_decode_match_transformers(case):
    """Several sequences per forward: a mixed prefill, a step mixing a prefill chunk with decodes,
    then batched decode steps (all q_len == 1: the padded ``_batched_decode`` path)."""
    hf, model, spec = case
    g = torch.Generator().manual_seed(2)
    seqs = PagedSequences(spec, seed=3)
    ids = [seqs.add(torch.randint(0, VOCAB, (n,), generator=g).tolist()) for n in (5, 10, 3)]
    a, b, c = ids

    def check(work, outs, label):
        for (s, n), lp in zip(work, outs):
            assert_close(lp, reference(hf, seqs.tokens[s][:seqs.cached[s]])[-n:], f"{label} seq {s}")

    def greedy_append(work, outs, sampled):
        for (s, _), lp in zip(work, outs):
            if s in sampled:
                seqs.tokens[s].append(int(lp[-1].argmax()))

    work = [(a, 5), (b, 6), (c, 3)]  # b's prompt is chunked: 6 now, 4 next step
    outs = run_step(model, seqs, work)
    check(work, outs, "mixed prefill")
    greedy_append(work, outs, {a, c})

    work = [(a, 1), (b, 4), (c, 1)]  # decodes around a prefill chunk that attends to 6 cached tokens
    outs = run_step(model, seqs, work)
    check(work, outs, "prefill chunk + decodes")
    greedy_append(work, outs, {a, b, c})

    for step in range(4):
        work = [(b, 1), (a, 1), (c, 1)]  # not in id order: rows follow the batch order
        outs = run_step(model, seqs, work)
        check(work, outs, f"batched decode {step}")
        greedy_append(work, outs, {a, b, c})


def test_bfloat16_load_runs_close_to_float32(tmp_path):
    hf = make_checkpoint(tmp_path, "Qwen3", dict(head_dim=32), {})
    model, spec = load_model(tmp_path, dtype="bfloat16")
    assert spec.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seqs = PagedSequences(spec)
    prompt = list(range(1, 10))
    (lp,) = run_step(model, seqs, [(seqs.add(prompt), len(prompt))])
    ref = reference(hf, prompt)
    assert lp.dtype == torch.float32
    # bf16 keeps ~3 significant digits: observed max |dlogprob| ~0.065 * std(logits)
    tol = 0.15 * ref.std()
    assert (lp - F.log_softmax(ref, dim=-1)).abs().max() < tol
    # within tol of every log-prob, the greedy token can only differ where the top two are within 2 tol
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert clear.sum() >= 3
    assert torch.equal(lp.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_dtype_auto_is_bf16_on_a_bf16_cpu_and_float32_for_tiny_models(tmp_path, caplog):
    """The CPU's flags are a parameter: an AMX or AVX512-BF16 CPU computes in bfloat16, an
    AVX2-only one in float32; an explicit dtype slower than float32 there is warned about."""
    from splitserve.testing.tiny import REPORT_NAME

    caplog.set_level("INFO", logger="splitserve.models.loader")
    make_checkpoint(tmp_path, "Llama", {}, {})
    amx, avx512_bf16, avx2 = {"avx2", "avx512f", "amx_bf16"}, {"avx2", "avx512f", "avx512_bf16"}, {"avx2", "fma"}
    assert load_model(tmp_path, cpu_flags=amx)[1].dtype == torch.bfloat16
    assert "--dtype auto: bfloat16 (the CPU has native bf16 (amx_bf16))" in caplog.text
    assert load_model(tmp_path, cpu_flags=avx512_bf16)[1].dtype == torch.bfloat16
    assert load_model(tmp_path, dtype="float32", cpu_flags=amx)[1].dtype == torch.float32  # an explicit choice stands
    assert load_model(tmp_path, cpu_flags=avx2)[1].dtype == torch.float32
    assert "--dtype auto: float32 (the CPU has no native bf16" in caplog.text
    assert "slower than float32" not in caplog.text
    caplog.clear()
    assert load_model(tmp_path, dtype="bfloat16", cpu_flags=avx2)[1].dtype == torch.bfloat16
    assert "--dtype bfloat16 is slower than float32 here: this CPU has no native bf16" in caplog.text
    caplog.clear()
    load_model(tmp_path, dtype="bfloat16", cpu_flags=amx)
    assert "slower than float32" not in caplog.text
    load_model(tmp_path, dtype="float16", cpu_flags=amx)
    assert "--dtype float16 is slower than float32 here" in caplog.text
    (tmp_path / REPORT_NAME).write_text("{}")  # what the tiny builder leaves in its folder
    assert load_model(tmp_path, cpu_flags=amx)[1].dtype == torch.float32
    assert "a tiny test model" in caplog.text


# -- the loader ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-small")
    make_checkpoint(path, "Llama", dict(num_hidden_layers=2, eos_token_id=2), {})
    return path


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_no_safetensors(llama_dir, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(d)


def test_unsupported_architecture_is_named_with_the_supported_ones(llama_dir, tmp_path):
    d = copy_of(llama_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(d)
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


def test_unsupported_rope_type_is_named(llama_dir, tmp_path):
    d = copy_of(llama_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="yarn"):
        load_model(d)


def test_missing_weights_are_named(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_of(llama_dir, tmp_path / "ckpt")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing 2 weight") as err:
        load_model(d)
    assert "model.layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "model.norm.weight" in str(err.value)


def test_generation_config_eos_and_defaults(llama_dir, tmp_path):
    d = copy_of(llama_dir, tmp_path / "ckpt")
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 2], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    _, spec = load_model(d)
    assert spec.eos_token_ids == (7, 2)  # generation_config's first, then config.json's (2, already there)
    assert spec.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert spec.name == "ckpt" and spec.path == str(d.resolve())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 9, "top_k": 20}))
    _, spec = load_model(d)
    assert spec.eos_token_ids == (9, 2) and spec.generation_defaults == {"top_k": 20}
    (d / "generation_config.json").unlink()
    _, spec = load_model(d)
    assert spec.eos_token_ids == (2,) and spec.generation_defaults == {}


def test_load_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded("hello world")["input_ids"] == [2, 3]
