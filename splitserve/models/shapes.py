"""Named shapes of real models, for checkpoints with random weights (``make_model.py``).

Speed depends on a model's shapes, not on what its weights learned: a shape here holds what a
published checkpoint's config.json says about its sizes (hidden size, layers, heads, KV heads, FFN
size, head dim, rope, norm epsilon, context, tied embeddings, q/k/v bias) and its real vocabulary
size, so that the matmuls, the attention and the LM head cost what they cost on that model.

``SHAPES`` holds the real ones and two small test shapes of the same families (the same code
path, a vocabulary padded past SmolLM2's 49,152 tokens, llama3 rope scaling on the Llama one).
A shape knows its tensors in Hugging Face naming and order (``tensors``), its GGUF names
(``gguf_name``), its config.json (``hf_config``) and how many bytes its weights and one token's
KV take in a given type (``weight_bytes``, ``kv_bytes_per_token``), which the benches set against
the memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""Llama 3.2's rope scaling (1B and 3B alike)."""

# bytes per element of each GGUF type a shape is written in (Q4_0: 18 bytes per 32, Q8_0: 34 per 32;
# Q4_K, 144 per 256, only as llama.cpp's quantizer writes it: a Q4_K_M file holds some Q6_K too)
TYPE_BYTES = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_K": 144 / 256}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Tensor:
    """One weight: its Hugging Face name, shape ([out, in] for a matrix) and what fills it."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "embed", "matrix", "norm" (ones) or "bias"

    @property
    def rows(self) -> int:
        return self.shape[0]


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # the GGUF architecture: "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tied: bool
    head_dim: int = 0  # 0: hidden // heads
    rope_scaling: Optional[dict] = None
    source: str = ""  # the checkpoint whose config.json this shape follows
    extra: dict = field(default_factory=dict)  # config.json fields of the family kept for other loaders

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def architecture(self) -> str:
        return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.arch]

    def tensors(self) -> list[Tensor]:
        """Every weight in Hugging Face naming and order (no ``lm_head`` when tied)."""
        h, d = self.hidden, self.dim
        out = [Tensor("model.embed_tokens.weight", (self.vocab, h), "embed")]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.append(Tensor(p + "input_layernorm.weight", (h,), "norm"))
            for proj, rows in (("q", self.heads * d), ("k", self.kv_heads * d), ("v", self.kv_heads * d)):
                out.append(Tensor(f"{p}self_attn.{proj}_proj.weight", (rows, h), "matrix"))
                if self.qkv_bias:
                    out.append(Tensor(f"{p}self_attn.{proj}_proj.bias", (rows,), "bias"))
            out.append(Tensor(p + "self_attn.o_proj.weight", (h, self.heads * d), "matrix"))
            out.append(Tensor(p + "post_attention_layernorm.weight", (h,), "norm"))
            out.append(Tensor(p + "mlp.gate_proj.weight", (self.ffn, h), "matrix"))
            out.append(Tensor(p + "mlp.up_proj.weight", (self.ffn, h), "matrix"))
            out.append(Tensor(p + "mlp.down_proj.weight", (h, self.ffn), "matrix"))
        out.append(Tensor("model.norm.weight", (h,), "norm"))
        if not self.tied:
            out.append(Tensor("lm_head.weight", (self.vocab, h), "matrix"))
        return out

    def parameters(self) -> int:
        return sum(_prod(t.shape) for t in self.tensors())

    def weight_bytes(self, kind: str) -> int:
        """Bytes of every weight with the matrices in ``kind`` (a GGUF type or a torch dtype name)
        and the norms and biases in float32: what a decode step reads (a tied head once)."""
        per = TYPE_BYTES.get(kind.upper()) or DTYPE_BYTES[kind]
        return int(sum(_prod(t.shape) * (per if len(t.shape) == 2 else 4) for t in self.tensors()))

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.layers * 2 * self.kv_heads * self.dim * DTYPE_BYTES[dtype]

    def hf_config(self, bos: int, eos: int, pad: Optional[int] = None) -> dict:
        """config.json as the family's checkpoints spell it (``rope_theta`` and ``rope_scaling`` at
        the top level, which transformers 4 and 5, vLLM and splitserve all read)."""
        config = {
            "architectures": [self.architecture], "model_type": self.arch, "hidden_act": "silu",
            "hidden_size": self.hidden, "intermediate_size": self.ffn, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.dim,
            "vocab_size": self.vocab, "max_position_embeddings": self.max_context,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tied, "bos_token_id": bos, "eos_token_id": eos,
            "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
            "dtype": "bfloat16", "torch_dtype": "bfloat16", **self.extra,
        }
        if pad is not None:
            config["pad_token_id"] = pad
        return config


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_LLAMA_EXTRA = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
_QWEN2_EXTRA = {"use_sliding_window": False}

SHAPES = {s.name: s for s in (
    Shape("qwen2.5-0.5b", "qwen2", hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936,
          rope_theta=1000000.0, rms_norm_eps=1e-6, max_context=32768, tied=True, source="Qwen/Qwen2.5-0.5B",
          extra={**_QWEN2_EXTRA, "sliding_window": 32768, "max_window_layers": 24}),
    Shape("llama-3.2-1b", "llama", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
          rope_theta=500000.0, rms_norm_eps=1e-5, max_context=131072, tied=True, head_dim=64,
          rope_scaling=LLAMA3_ROPE, source="meta-llama/Llama-3.2-1B", extra=_LLAMA_EXTRA),
    Shape("llama-3.2-3b", "llama", hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256,
          rope_theta=500000.0, rms_norm_eps=1e-5, max_context=131072, tied=True, head_dim=128,
          rope_scaling=LLAMA3_ROPE, source="meta-llama/Llama-3.2-3B", extra=_LLAMA_EXTRA),
    # small shapes of the same families for the tests: SmolLM2's vocabulary padded by 128
    Shape("llama-3.2-test", "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=49280,
          rope_theta=500000.0, rms_norm_eps=1e-5, max_context=16384, tied=True, head_dim=16,
          rope_scaling=LLAMA3_ROPE, source="a test shape of Llama 3.2", extra=_LLAMA_EXTRA),
    Shape("qwen2.5-test", "qwen2", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=49280,
          rope_theta=1000000.0, rms_norm_eps=1e-6, max_context=16384, tied=True,
          source="a test shape of Qwen2.5", extra={**_QWEN2_EXTRA, "sliding_window": 16384, "max_window_layers": 2}),
)}
BENCH_SHAPES = {"0.5b": "qwen2.5-0.5b", "1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}
"""The short names benches take (``--shape``)."""


def shape(name: str) -> Shape:
    """The shape named ``name`` (a key of SHAPES or BENCH_SHAPES); ValueError listing them."""
    found = SHAPES.get(BENCH_SHAPES.get(name, name))
    if found is None:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join([*SHAPES, *BENCH_SHAPES])}")
    return found


# llama.cpp's tensor names: HF suffix -> GGUF suffix
_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """The name llama.cpp's converter gives a Hugging Face tensor."""
    base, suffix = hf_name.rsplit(".", 1)
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"
