"""The decoder of the Llama family, and the one implementation Qwen2 and Qwen3 reuse.

One pre-norm decoder block, repeated::

    h = h + o_proj(paged_attention(rope(q), rope(k), v))     q, k, v = qkv_proj(rmsnorm(h))
    h = h + down_proj(silu(gate) * up)                        gate, up = gate_up_proj(rmsnorm(h))

The variants differ only in flags of ``DecoderArgs``: Llama may have ``attention_bias`` /
``mlp_bias`` (both off in released checkpoints), Qwen2 has a bias on q/k/v only (``qwen2.py``),
Qwen3 normalises q and k per head before rope (``qwen3.py``). Mistral-style checkpoints saved as
``LlamaForCausalLM`` (explicit ``head_dim``, large ``rope_theta``) are plain Llama here.

The batch is flat: ``T`` new tokens of all scheduled sequences, with ``positions`` [T] and the
attention metadata describing which sequence each belongs to (``layers/attention.py``). Every
layer writes its new keys/values into the paged KV pool, then attends over the pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.attention import AttentionMetadata, KVLayers, paged_attention
from splitserve.layers.linear import Embedding, Linear, MergedLinear, pack_weight, packed_linear
from splitserve.layers.norm import RMSNorm
from splitserve.layers.ops import TorchOps
from splitserve.layers.quant import RawQuant
from splitserve.layers.rotary import RotaryEmbedding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderArgs:
    """What the decoder needs from ``config.json``, parsed once (see ``parse_config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]  # None, or {"rope_type": "llama3" | "linear", ...}
    max_context: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def _no_progress() -> None:
    pass


def _required(config: dict, key: str):
    if config.get(key) is None:
        raise ValueError(f"config.json lacks required field {key!r}")
    return config[key]


def parse_rope(config: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from either spelling of config.json: transformers 4 writes ``rope_theta`` at
    the top level and ``rope_scaling`` (null or a dict with ``type``/``rope_type``); transformers 5
    writes one ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, params


def _dense_shape(module: nn.Module) -> tuple[int, ...]:
    """The shape of a module's weight as the checkpoint holds it (a quantized layer's own is empty)."""
    if isinstance(module, Linear):
        return (module.out_features, module.in_features)
    if isinstance(module, Embedding):
        return (module.num_embeddings, module.embedding_dim)
    return tuple(module.weight.shape)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedLinear(args.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=args.qkv_bias)
        self.o_proj = Linear(q_size, args.hidden_size, bias=args.o_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata, kv: KVLayers, ops: TorchOps) -> torch.Tensor:
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]: q | k | v, rotated in place and read through views
        T = qkv.shape[0]
        if self.qk_norm:
            q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        kv_layer = kv.layer(self.layer_idx)  # [num_pages, 2, page_size, Hkv, D]
        ops.rope_store(qkv, rope, H, Hkv, kv_layer, meta)
        q = qkv[:, :H * D].view(T, H, D)
        new_kv = qkv[:, H * D:].view(T, 2, Hkv, D)  # k | v
        o = paged_attention(q, new_kv[:, 0], new_kv[:, 1], kv_layer, meta, self.scale,
                            ops.decode_attention, ops.prefill_attention)  # [T, H, D]
        return self.o_proj(o.flatten(1))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedLinear(args.hidden_size, {"gate": inter, "up": inter}, bias=args.mlp_bias)
        self.down_proj = Linear(inter, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))  # [T, hidden] -> [T, 2I] -> [T, I] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, residual, delta, rope, meta, kv, ops):
        """The residual stream and the previous block's output not yet added to it (None before
        the first layer) -> the same pair after this layer (adds fused with the next norm)."""
        x, residual = ops.add_rms_norm(delta, residual, self.input_layernorm)
        x, residual = ops.add_rms_norm(self.self_attn(x, rope, meta, kv, ops), residual, self.post_attention_layernorm)
        return residual, self.mlp(x, ops)


class DecoderModel(nn.Module):
    """Embedding, layers and final norm; parameter names match the checkpoint's ``model.*``."""

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling)

    def forward(self, input_ids, positions, meta, kv, ops, progress: Callable[[], None]):
        residual = self.embed_tokens(input_ids)  # [T, hidden]
        rope = ops.rope_tables(*self.rotary.cos_sin(positions), residual.dtype)  # once for all layers
        delta = None
        for layer in self.layers:
            residual, delta = layer(residual, delta, rope, meta, kv, ops)
            progress()
        return ops.add_rms_norm(delta, residual, self.norm)[0]


class LlamaForCausalLM(nn.Module):
    """Llama 2/3/3.x. Subclasses change ``parse_config`` only."""

    # checkpoint projection -> (our merged module, its part)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: dict):
        """``config``: the checkpoint's ``config.json`` as a dict."""
        super().__init__()
        self.args = self.parse_config(config)
        self.ops: TorchOps = TorchOps()  # the per-layer small ops; the model runner may swap in compiled ones
        self.progress: Callable[[], None] = _no_progress  # called after each layer; the model runner sets it
        self.model = DecoderModel(self.args)
        if not self.args.tie_word_embeddings:
            self.lm_head = Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        self._packed_head: Optional[torch.Tensor] = None  # set by pack_weights

    @classmethod
    def parse_config(cls, config: dict) -> DecoderArgs:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
        hidden, heads = _required(config, "hidden_size"), _required(config, "num_attention_heads")
        theta, scaling = parse_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        return DecoderArgs(
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(config, "intermediate_size"),
            num_layers=_required(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_context=_required(config, "max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    def set_ops(self, ops: TorchOps) -> int:
        """Run the per-layer ops through ``ops`` (``layers/ops.py``), and the dense float32 weights
        through its matmuls where it has them: the projections repacked once for its
        ``linear_packed`` (their dense weights dropped), a tied head through its ``linear`` on the
        embedding as it is. Returns the number of weights given them (a tied head counted)."""
        self.ops = ops
        if ops.linear_packed is None:
            return 0
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.quant is None and m.packed is None
                   and m.weight.dtype == torch.float32 and m.f32_packed is None and m.weight.numel()]
        for m in linears:
            m.pack_f32(ops.pack_linear, ops.linear_packed)
        packed = sum(1 for m in self.modules() if isinstance(m, Linear) and m.f32_packed is not None)
        tied = self.args.tie_word_embeddings and self.model.embed_tokens.quant is None \
            and self.model.embed_tokens.weight.dtype == torch.float32
        return packed + int(tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVLayers) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed, before lm_head)."""
        return self.model(input_ids, positions, meta, kv, self.ops, self.progress)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. Pass only the rows you sample from."""
        if self._packed_head is not None:
            return packed_linear(hidden, self._packed_head).float()
        if not self.args.tie_word_embeddings:
            return self.lm_head(hidden).float()
        embed = self.model.embed_tokens
        if embed.quant is not None:
            return embed.quant.linear(hidden).float()
        if self.ops.linear is not None and embed.weight.dtype == torch.float32:
            return self.ops.linear(hidden, embed.weight, None)
        return F.linear(hidden, embed.weight).float()

    def pack_weights(self, batch_hint: int = 16) -> int:
        """Switch every projection and the logits head to packed weights (``layers/linear.py``;
        call ``linear.packing_available`` first). A tied head keeps the embedding it shares, so
        its packed copy is extra memory (vocab x hidden). Returns the number of weights packed."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.packed is None and m.quant is None]
        for m in linears:
            m.pack(batch_hint)  # an untied head is one of them
        if self.args.tie_word_embeddings and self.model.embed_tokens.quant is None:
            self._packed_head = pack_weight(self.model.embed_tokens.weight.detach(), batch_hint)
            return len(linears) + 1
        return len(linears)

    # -- weights ---------------------------------------------------------------------------------

    def quantizable(self) -> dict[str, tuple[str, list[str]]]:
        """The layers whose weight may be quantized: module path -> (role, the checkpoint tensors
        that fill it, in order). Roles: ``linear`` (the projections), ``embedding`` (the token
        embedding, which a tied model's logits head shares) and ``head`` (an untied head)."""
        parts: dict[str, list[str]] = {}
        for name in self.checkpoint_names():
            module_path, kind = name.rsplit(".", 1)
            target = self._target_module(module_path)
            if kind == "weight" and isinstance(self.get_submodule(target), (Linear, Embedding)):
                parts.setdefault(target, []).append(name)
        roles = {"model.embed_tokens": "embedding", "lm_head": "head"}
        return {path: (roles.get(path, "linear"), names) for path, names in parts.items()}

    def expect_quantized(self, kinds: dict[str, str]) -> None:
        """Before loading: the layers (module path -> type) whose weights arrive as raw blocks."""
        for path, kind in kinds.items():
            self.get_submodule(path).expect_quantized(kind)

    def finish_quantized(self, ops) -> int:
        """After loading: pack every quantized layer's blocks (``ops``: the compiled kernels).
        Returns the number of layers quantized."""
        layers = [m for m in self.modules() if isinstance(m, (Linear, Embedding)) and m.quant_kind is not None
                  and m.quant is None]
        for m in layers:
            m.finish_quantized(ops)
        return len(layers)

    def _target_module(self, module_path: str) -> str:
        """The module a checkpoint module path loads into (``q_proj`` -> ``qkv_proj``)."""
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.packed_modules:
            merged = self.packed_modules[leaf][0]
            return f"{parent}.{merged}" if parent else merged
        return module_path

    def checkpoint_names(self) -> list[str]:
        """The checkpoint tensors this model needs, by their Hugging Face names."""
        unpacked: dict[str, list[str]] = {}
        for name, (merged, _) in self.packed_modules.items():
            unpacked.setdefault(merged, []).append(name)
        names = []
        for pname, _ in self.named_parameters():
            module_path, kind = pname.rsplit(".", 1)
            parent, _, leaf = module_path.rpartition(".")
            for ckpt_leaf in unpacked.get(leaf, [leaf]):
                names.append(f"{parent}.{ckpt_leaf}.{kind}" if parent else f"{ckpt_leaf}.{kind}")
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by their HF names (``model.layers.0.self_attn.q_proj.weight``).
        Raises ValueError naming every tensor the model needs but did not get; tensors the model
        has no use for are logged and skipped."""
        params = dict(self.named_parameters())
        missing = set(self.checkpoint_names())
        unused = []
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.args.tie_word_embeddings):
                continue  # recomputed / shared with the embedding
            if "." not in name:
                unused.append(name)
                continue
            module_path, kind = name.rsplit(".", 1)
            parent, _, leaf = module_path.rpartition(".")
            part = None
            if leaf in self.packed_modules:
                merged, part = self.packed_modules[leaf]
                if f"{parent}.{merged}.{kind}" not in params:
                    unused.append(name)
                    continue
                module = self.get_submodule(f"{parent}.{merged}")
                target = module.part(part, kind) if module.quant_kind is None or kind != "weight" else None
                rows = module.offsets[part][1]
                expected = (rows, module.in_features) if kind == "weight" else (rows,)
            elif name in params:
                module = self.get_submodule(module_path)
                target = params[name]
                expected = _dense_shape(module) if kind == "weight" else tuple(target.shape)
            else:
                unused.append(name)
                continue
            quantized = isinstance(tensor, RawQuant)
            if quantized != (kind == "weight" and getattr(module, "quant_kind", None) is not None):
                raise ValueError(f"{name}: the loader's plan and the tensor disagree (raw blocks: {quantized})")
            shape = tuple(tensor.shape)
            if shape != tuple(expected):
                raise ValueError(f"shape mismatch for {name}: checkpoint {shape}, "
                                 f"model expects {tuple(expected)}")
            if quantized:
                if tensor.kind != module.quant_kind:
                    raise ValueError(f"{name}: raw {tensor.kind} blocks for a layer expecting {module.quant_kind}")
                module.stage_part(part, tensor.raw)
            else:
                target.copy_(tensor)
            missing.discard(name)
        if unused:
            log.warning("ignored %d checkpoint tensors the model does not use: %s%s", len(unused),
                        ", ".join(unused[:10]), " ..." if len(unused) > 10 else "")
        if missing:
            shown = sorted(missing)
            raise ValueError(f"checkpoint is missing {len(shown)} weight tensor(s): {', '.join(shown[:20])}"
                             + (" ..." if len(shown) > 20 else ""))
