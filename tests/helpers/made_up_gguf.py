"""Made-up GGUF files: a small random transformers model of a family written as llama.cpp writes
it (its tensor names, its q/k permutation, its rope factors), with a byte-level tokenizer
(``byte_tok``, a fixture)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
# llama.cpp's tensor names (its "standardized tensor names"), HF suffix -> GGUF suffix
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of llama's q/k rows (its rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for Llama 3.1 rope scaling (its formula)."""
    factors = []
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = ((rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def add_byte_tokenizer(writer, tok) -> None:
    """``byte_tok`` as GGUF ``gpt2`` tokenizer metadata (llama.cpp's token types: 1 normal, 3 control)."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_chat_template(tok.chat_template)


def write_family_gguf(path: Path, hf, arch: str, name: str, tok, raw_types: dict | None = None,
                      quantize=None) -> None:
    """``quantize(gguf name)``: the type a tensor is written in (gguf's quantizer), None: float32."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = c.rope_parameters["rope_theta"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    add_byte_tokenizer(w, tok)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "llama" and ".q_proj." in hf_name:
            tensor = llama_cpp_permute(tensor, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            tensor = llama_cpp_permute(tensor, c.num_key_value_heads)
        kind = quantize(gguf_name(hf_name)) if quantize else None
        if kind is None:
            w.add_tensor(gguf_name(hf_name), tensor.numpy())
        else:
            w.add_tensor(gguf_name(hf_name), gguf.quants.quantize(tensor.numpy(), kind), raw_dtype=kind)
    rope = (c.rope_parameters or {})
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(head_dim, theta, rope))
    for tensor_name, raw in (raw_types or {}).items():
        w.add_tensor(tensor_name, raw[0], raw_dtype=raw[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_model(family: str, overrides: dict, vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**{**SMALL, **overrides}, vocab_size=vocab_size)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # off the init values: norms off 1, biases off 0
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module")
def byte_tok():
    """One token per byte, one merge ("h e" -> "he"), ``<s>``/``</s>`` and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet + ["he", "<s>", "</s>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    return fast
