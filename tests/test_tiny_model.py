"""The built-in tiny model: files, loading, tokenizer, chat template, build-time guarantees, cache.

Builds cost ~1-3 s each; the module builds five times: each arch once (fixture `built`), llama
again through the cache (`llama_cache`, also the byte-identity check) and qwen2 by three racing
processes. Broken folders and crashed builds are exercised with a fake builder.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.testing import tiny
from splitserve.testing.tiny import (
    ARCHS,
    GAP_FACTOR,
    REPORT_NAME,
    SPECIAL_TOKENS,
    build_tiny_model,
    tiny_model_cache_dir,
    tiny_model_path,
)

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", REPORT_NAME)
ROUND_TRIP = [
    "",
    "Hello, world!",
    "naïve café, résumé, Ångström, ß, œuvre",
    "日本語のテキスト，中文句子。한국어 문장",
    "emoji 🙂🚀👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "  leading spaces\n\n\ttabs\r\nCRLF  trailing  \n",
    "<|im_start|>user\nnot really a chat<|im_end|>\n",
    "\x00 control \x07 chars \u200b zero-width",
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}\n",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


def _report(path: Path) -> dict:
    return json.loads((path / REPORT_NAME).read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_files_and_auto_classes_load(built, arch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = built[arch]
    for name in FILES:
        assert (path / name).is_file(), name
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == arch
    assert config.vocab_size >= 1024
    assert config.max_position_embeddings >= 8192
    assert config.num_hidden_layers >= 4
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.tie_word_embeddings == (arch == "qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.is_fast
    assert len(tok) == config.vocab_size
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in params
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in params
        assert config.head_dim * config.num_attention_heads != config.hidden_size
    gen = json.loads((path / "generation_config.json").read_text())
    assert tok.eos_token_id in gen["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_and_specials(built, arch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[arch])
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, repr(text)
    assert len(tok.encode("the server reads the request")) < len("the server reads the request")
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == SPECIAL_TOKENS[:3]
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(5))


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(built, arch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[arch])
    assert "chat_template" in json.loads((built[arch] / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|startoftext|><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    closed = tok.apply_chat_template(messages + [{"role": "assistant", "content": "Yo"}],
                                     tokenize=False)
    assert closed.endswith("<|im_start|>assistant\nYo<|im_end|>\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == prompt
    ids = tok.encode(prompt)
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")]


@pytest.mark.parametrize("arch", ARCHS)
def test_report_meets_thresholds(built, arch):
    r = _report(built[arch])
    assert r["ok"] and all(r["checks"].values()), r["checks"]
    assert r["format_version"] == tiny.FORMAT_VERSION and r["arch"] == arch and r["seed"] == 0
    assert r["gap_factor_required"] == GAP_FACTOR >= 100
    assert 0 < r["max_error"] < 1e-3
    assert r["min_gap"] > GAP_FACTOR * r["max_error"]
    assert r["gap_over_error"] > GAP_FACTOR
    assert r["min_special_margin"] > GAP_FACTOR * r["max_error"]
    assert r["context_divergence_step"] is not None and r["context_divergence_step"] < 32
    assert r["distinct_tokens_in_64"] >= 16
    assert r["decoded_steps_checked"] >= 200
    assert r["attempts"][-1]["seed"] == r["effective_seed"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_never_stops_and_depends_on_context(built, arch):
    """With transformers' own `generate`: no special token in 32 greedy tokens for several
    prompts, and the build's context probe (one token changed 100 positions back) diverges."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[arch])
    model = AutoModelForCausalLM.from_pretrained(built[arch], dtype=torch.float32).eval()
    chat = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                   add_generation_prompt=True, tokenize=False)
    texts = ["Hello", chat, "The quick brown fox " * 20, "日本語 🙂 " * 5 + "\n\n"]
    probes = tiny._probe_prompts(tok.backend_tokenizer)
    base, altered = probes[tiny._BASE], probes[tiny._BASE + 1]
    prompts = [tok.encode(t) for t in texts] + [base, altered]
    outputs = []
    with torch.inference_mode(), tiny._one_torch_thread():  # decode-sized ops: see the helper
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), do_sample=False, max_new_tokens=32)
            new = out[0, len(ids):].tolist()
            assert len(new) == 32, "generation stopped early"
            assert not set(new) & set(range(len(SPECIAL_TOKENS))), new
            outputs.append(new)
    assert outputs[-1] != outputs[-2], "changing one early token did not change the output"
    assert len(set(outputs[-2])) >= 8
    assert len({tuple(o) for o in outputs}) == len(outputs)


def test_candidate_seeds_are_fixed():
    assert tiny._candidate_seed(7, 0) == 7
    assert tiny._candidate_seed(7, 1) == tiny._candidate_seed(7, 1) != tiny._candidate_seed(7, 2)
    assert 0 <= tiny._candidate_seed(7, 3) < 2**63


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mistral"):
        build_tiny_model(tmp_path, arch="mistral")
    with pytest.raises(ValueError, match="mistral"):
        tiny_model_path(arch="mistral")


def test_cache_dir_is_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "a"))
    assert tiny_model_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPLITSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny_model_cache_dir() == tmp_path / "home" / ".cache" / "splitserve"


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory) -> Path:
    """A cache folder in which tiny_model_path("llama", 0) has built once."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE", str(root))
        tiny_model_path("llama", seed=0)
    return root


def test_same_seed_gives_identical_files(built, llama_cache):
    """The cache's build and the fixture's are two independent builds of llama seed 0."""
    again = llama_cache / f"tiny-llama-seed0-v{tiny.FORMAT_VERSION}"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        assert (again / name).read_bytes() == (built["llama"] / name).read_bytes(), name
    assert _report(again)["effective_seed"] == _report(built["llama"])["effective_seed"]


def test_cache_builds_once_and_reuses(llama_cache, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(llama_cache))
    path = llama_cache / f"tiny-llama-seed0-v{tiny.FORMAT_VERSION}"
    stamp = (path / REPORT_NAME).stat()
    assert tiny_model_path("llama", seed=0) == path
    assert tiny_model_path("llama", seed=0) == path
    assert (path / REPORT_NAME).stat().st_mtime_ns == stamp.st_mtime_ns  # not rebuilt
    assert (path / REPORT_NAME).stat().st_ino == stamp.st_ino
    assert [p.name for p in llama_cache.iterdir() if not p.name.endswith(".lock")] == [path.name]


def _fake_build(calls: list):
    """Stands in for build_tiny_model: writes a complete-looking folder, counts calls."""
    def build(out_dir, arch="llama", seed=0):
        calls.append((Path(out_dir), arch, seed))
        out = Path(out_dir)
        for name in FILES:
            (out / name).write_text("{}")
        (out / REPORT_NAME).write_text(json.dumps({"ok": True,
                                                   "format_version": tiny.FORMAT_VERSION}))
        return out
    return build


def test_cache_replaces_broken_folders_and_cleans_up(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(tiny, "build_tiny_model", _fake_build(calls))
    final = tmp_path / f"tiny-qwen3-seed5-v{tiny.FORMAT_VERSION}"
    crashed = tmp_path / f".{final.name}.tmp-abc123"  # left by a build that was killed
    crashed.mkdir()
    assert tiny_model_path("qwen3", seed=5) == final
    assert tiny_model_path("qwen3", seed=5) == final
    assert len(calls) == 1 and calls[0][1:] == ("qwen3", 5)
    assert calls[0][0].parent == tmp_path and calls[0][0].name.startswith(f".{final.name}.tmp-")
    assert not crashed.exists() and not calls[0][0].exists()

    (final / "model.safetensors").unlink()  # broken: rebuilt, never trusted
    assert tiny_model_path("qwen3", seed=5) == final and len(calls) == 2
    assert (final / "model.safetensors").is_file()
    (final / REPORT_NAME).write_text(json.dumps({"ok": False, "format_version": 1}))
    assert tiny_model_path("qwen3", seed=5) == final and len(calls) == 3

    def failing(out_dir, arch="llama", seed=0):
        (Path(out_dir) / "partial").write_text("x")
        raise tiny.TinyModelCheckError("no seed passed")
    monkeypatch.setattr(tiny, "build_tiny_model", failing)
    with pytest.raises(tiny.TinyModelCheckError):
        tiny_model_path("llama", seed=9)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [final.name]


def test_concurrent_callers_share_one_build(monkeypatch, tmp_path):
    """Three processes ask at once: one builds under the lock, the others wait and reuse (a
    second build would fail: its rename onto the finished folder raises). The children import
    only splitserve.testing.tiny, so the waiting ones stay cheap."""
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))  # inherited by the children
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        paths = pool.starmap(tiny_model_path, [("qwen2", 0)] * 3)
    assert len(set(paths)) == 1, paths
    path = paths[0]
    assert path.parent == tmp_path
    assert all((path / name).is_file() for name in FILES)
    assert _report(path)["ok"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        [path.name]
    stamp = (path / REPORT_NAME).stat().st_mtime_ns
    assert tiny_model_path("qwen2", 0) == path
    assert (path / REPORT_NAME).stat().st_mtime_ns == stamp


def test_the_runtime_never_imports_the_test_machinery():
    """splitserve.testing is imported only when `--model tiny` or `tiny-model` asks for it."""
    code = ("import sys, splitserve.cli, splitserve.engine.engine, splitserve.server.app, splitserve.disagg.worker, "
            "splitserve.router.app, splitserve.models.resolve, splitserve.models.loader, splitserve.models.gguf\n"
            "print(sorted(m for m in sys.modules if m.startswith('splitserve.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
