"""Real model shapes with random weights (``splitserve/models/make_model.py`` and its parts).

- the named shapes have the published models' sizes (parameter counts of Qwen2.5-0.5B,
  Llama-3.2-1B and Llama-3.2-3B) and vocabularies;
- on the small test shapes (the same code path, a vocabulary padded past SmolLM2's): the BF16 GGUF
  file holds bit for bit the Hugging Face folder's weights (Llama's q/k rows in llama.cpp's
  layout), Q8_0 and Q4_0 the same values quantized, a ``rope_freqs`` tensor where llama3 rope
  scaling is; both have SmolLM2's tokens then ``[PAD<id>]`` tokens up to the vocabulary size;
- splitserve serves the folder: finite, spread logits, greedy decoding that moves on and never
  picks a control or padding token; ``long``: splitserve's conversion of the GGUF gives the same
  logits and greedy tokens as the folder;
- ``make-model`` refuses a type it cannot write, naming how to get it; ``bench/vs_refs.py
  --shape`` plans its servers on the shape's files without starting any (``--dry-run``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from conftest import REPO
from helpers.paged_sequences import PagedSequences, run_step
from splitserve.models import shape_gguf
from splitserve.models.loader import load_model, load_tokenizer
from splitserve.models.make_model import make_model
from splitserve.models.shape_vocab import UNUSED
from splitserve.models.shapes import SHAPES, gguf_name, shape

gguf = pytest.importorskip("gguf")

SMOLLM2_TOKENS = 49152
PROMPT = "The capital of France is"
STEPS = 8


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{test shape: {"BF16"/"Q8_0"/"Q4_0"/"hf": path}} in one folder."""
    out = tmp_path_factory.mktemp("shapes")
    return {"llama-3.2-test": make_model("llama-3.2-test", out, ("BF16", "Q8_0", "Q4_0")),
            "qwen2.5-test": make_model("qwen2.5-test", out, ("BF16",))}


def test_shapes_are_the_published_models_sizes():
    published = {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824}
    for name, count in published.items():
        assert SHAPES[name].parameters() == count, name
    assert (shape("0.5b").vocab, shape("1b").vocab, shape("3b").vocab) == (151_936, 128_256, 128_256)
    config = shape("1b").hf_config(bos=1, eos=2)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
    assert config["tie_word_embeddings"] and config["head_dim"] == 64 and config["num_key_value_heads"] == 8
    assert shape("0.5b").hf_config(bos=1, eos=2)["rope_scaling"] is None and shape("0.5b").qkv_bias


def _gguf(path):
    """(metadata, {name: (ggml type, raw array)}) by transformers' reader (fast on a 49k vocabulary)."""
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

    meta, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens",))
    header = GgufHeader.from_file(str(path))
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    tensors = {t.name: (t.ggml_type, blob[header.data_start + t.offset:][:t.nbytes]) for t in header.tensors}
    return meta, tensors, {t.name: t.shape for t in header.tensors}


def _hf_weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("name", ["llama-3.2-test", "qwen2.5-test"])
def test_gguf_holds_the_folders_weights_and_a_padded_vocabulary(written, name):
    s, files = SHAPES[name], written[name]
    meta, tensors, shapes = _gguf(files["BF16"])
    hf = _hf_weights(files["hf"])
    assert sorted(hf) == sorted(t.name for t in s.tensors()) and "lm_head.weight" not in hf  # tied
    for hf_name, value in hf.items():
        ggml_type, raw = tensors[gguf_name(hf_name)]
        assert shapes[gguf_name(hf_name)] == tuple(value.shape), hf_name
        if value.dim() == 1:  # norms and biases in F32, the same values
            assert ggml_type == gguf.GGMLQuantizationType.F32 and torch.equal(
                torch.from_numpy(raw.view(np.float32).copy()), value.float()), hf_name
            continue
        stored = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(value.shape)
        if s.arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = s.heads if ".q_proj." in hf_name else s.kv_heads
            value = shape_gguf.llama_cpp_permute(value, heads)
        assert ggml_type == gguf.GGMLQuantizationType.BF16 and torch.equal(stored, value), hf_name
    assert ("rope_freqs.weight" in tensors) == (s.rope_scaling is not None)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == s.vocab == json.loads((files["hf"] / "config.json").read_text())["vocab_size"]
    assert tokens[SMOLLM2_TOKENS:] == [f"[PAD{i}]" for i in range(SMOLLM2_TOKENS, s.vocab)]
    assert set(types[SMOLLM2_TOKENS:]) == {UNUSED} and UNUSED not in types[:SMOLLM2_TOKENS]
    tok = Tokenizer.from_file(str(files["hf"] / "tokenizer.json"))
    assert tok.token_to_id(tokens[-1]) == s.vocab - 1 and max(tok.encode(PROMPT).ids) < SMOLLM2_TOKENS


def test_quantized_files_hold_the_same_weights_quantized(written):
    from gguf.quants import dequantize

    files = written["llama-3.2-test"]
    hf = _hf_weights(files["hf"])
    for kind, tolerance in (("Q8_0", 0.01), ("Q4_0", 0.12)):  # RMS error / RMS value
        _, tensors, _ = _gguf(files[kind])
        for hf_name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
            ggml_type, raw = tensors[gguf_name(hf_name)]
            assert ggml_type == gguf.GGMLQuantizationType[kind], (kind, hf_name)
            value = hf[hf_name].float()
            got = torch.from_numpy(dequantize(np.array(raw), ggml_type).reshape(value.shape))
            assert ((got - value).pow(2).mean() / value.pow(2).mean()).sqrt() < tolerance, (kind, hf_name)


def greedy(folder, steps: int = STEPS):
    """(first logits [prompt, vocab], greedy tokens) of splitserve on ``folder``, float32."""
    model, spec = load_model(folder, dtype="float32")
    prompt = Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).encode(PROMPT).ids
    seqs = PagedSequences(spec)
    s = seqs.add(prompt)
    (first,) = run_step(model, seqs, [(s, len(prompt))])
    logprobs, tokens = first, []
    for _ in range(steps):
        tokens.append(int(logprobs[-1].argmax()))
        seqs.tokens[s].append(tokens[-1])
        (logprobs,) = run_step(model, seqs, [(s, 1)])
    return first, tokens


def test_splitserve_serves_the_folder_with_sane_logits(written):
    from splitserve.models.shape_vocab import padded_vocabulary

    s = SHAPES["llama-3.2-test"]
    logprobs, tokens = greedy(written["llama-3.2-test"]["hf"])
    assert torch.isfinite(logprobs).all() and logprobs.shape[-1] == s.vocab
    assert logprobs.exp()[-1].max() < 0.5 and logprobs[-1].std() > 0.05  # spread, not one-hot, not flat
    assert len(set(tokens)) >= STEPS // 2  # no repetition loop from the first step
    assert not set(tokens) & set(padded_vocabulary(s.vocab).quiet)


@pytest.mark.long  # splitserve's conversion of a 49k-token GGUF takes 10-30 s here
@pytest.mark.parametrize("name", ["llama-3.2-test", "qwen2.5-test"])
def test_splitserve_gives_the_gguf_and_the_folder_the_same_logits(written, name, tmp_path, monkeypatch):
    from splitserve.models.resolve import resolve_model_dir

    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    converted = resolve_model_dir(str(written[name]["BF16"]))
    (from_gguf, gguf_tokens), (from_hf, hf_tokens) = greedy(converted), greedy(written[name]["hf"])
    assert gguf_tokens == hf_tokens
    assert torch.equal(from_gguf, from_hf)
    assert load_tokenizer(converted)(PROMPT)["input_ids"] == load_tokenizer(written[name]["hf"])(PROMPT)["input_ids"]


def test_make_model_refuses_a_type_it_cannot_write_and_names_the_way(tmp_path, capsys):
    from splitserve.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["make-model", "1b", str(tmp_path), "--gguf", "Q4_K"])
    assert "Q4_K" in str(refused.value) and "llama-quantize" in str(refused.value)
    assert not any(tmp_path.iterdir())


def test_vs_refs_plans_a_shape_without_making_or_starting_anything(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import vs_refs

    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["vs_refs.py", "--shape", "1b", "--dry-run", "--read-bandwidth", "20",
                                      "--setups", "colocated,colocated-quant,vllm,llamacpp",
                                      "--llamacpp-python", sys.executable, "--vllm-python", sys.executable])
    assert vs_refs.main() == 0
    out = capsys.readouterr().out
    assert "llama-3.2-1b-q4_0.gguf" in out and "llama-3.2-1b-bf16" in out and "llama_cpp.server" in out
    assert out.count("memory allows ITL >= ") == 4 and not (tmp_path / "cache").exists()


def test_memory_fractions_set_decode_figures_against_the_bytes_a_step_reads():
    sys.path.insert(0, str(REPO / "bench"))
    from memory_bound import Step, fractions

    from splitserve.bench.stats import Summary

    step = Step(weights=900, kv_per_token=1)  # bytes: a step of one stream at context 100 reads 1,000
    one = Summary(duration_s=10.0, completed=2, failed=0, cancelled=0, request_throughput=0.2,
                  output_throughput=5.0, input_throughput=8.0, goodput=None, goodput_fraction=None,
                  itl_ms={"p50": 200.0, "p99": 400.0})  # prompts of 40 tokens, + half of 120 output
    got = fractions(step, bandwidth=10_000.0, one=one, many=None, streams=16, output_tokens=120)
    assert set(got) == {"one_tok_s", "one_itl_p50", "one_itl_p99"}  # no TTFT, no many-stream figure
    assert got["one_itl_p50"] == pytest.approx(0.5) and got["one_itl_p99"] == pytest.approx(0.25)
    assert got["one_tok_s"] == pytest.approx(0.5)  # 5 tok/s of the 10 a 0.1 s step allows


def test_the_fast_gguf_writer_writes_what_the_gguf_librarys_writer_writes(tmp_path):
    from splitserve.models.shape_vocab import Vocabulary, add_to_gguf, gguf_writer

    vocab = Vocabulary(tokens=["<s>", "a", "b", "ab", "é", "[PAD5]"], token_types=[3, 1, 1, 1, 1, UNUSED],
                       merges=["a b"], fields={"model": "gpt2", "pre": "smollm", "bos_token_id": 0,
                                               "add_bos_token": False}, chat_template="{{ x }}", real=5, quiet=(0, 5))
    for path, writer in ((tmp_path / "fast.gguf", gguf_writer(tmp_path / "fast.gguf", "llama")),
                         (tmp_path / "stock.gguf", gguf.GGUFWriter(str(tmp_path / "stock.gguf"), "llama"))):
        add_to_gguf(writer, vocab)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
    assert (tmp_path / "fast.gguf").read_bytes() == (tmp_path / "stock.gguf").read_bytes()


def test_q4k_files_come_from_the_reference_quantizer_and_name_their_types(tmp_path, monkeypatch):
    """The plumbing only: a stand-in for the llama-cpp-python venv's python copies the BF16 file."""
    sys.path.insert(0, str(REPO / "bench"))
    import q4k

    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    stand_in = tmp_path / "python"
    stand_in.write_text("#!/bin/sh\n# $1: quantize.py, $2: in, $3: out, $4: the type\ncp \"$2\" \"$3\"\n")
    stand_in.chmod(0o755)
    path = q4k.q4k_gguf("llama-3.2-test", str(stand_in))
    assert path.name == "llama-3.2-test-q4_k_m.gguf" and path.is_file()
    assert q4k.q4k_gguf("llama-3.2-test", None) == path  # made once: no quantizer needed the second time
    types = json.loads((path.parent / q4k.TYPES).read_text())
    assert set(types) == {"BF16", "F32"} and "token_embd.weight" in types["BF16"]
    with pytest.raises(SystemExit, match="setup_llamacpp.sh"):
        q4k.q4k_gguf("qwen2.5-test", None)
