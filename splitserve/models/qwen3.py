"""Qwen3 (dense): the Llama decoder (``llama.py``) with an RMSNorm over each head of q and k before
rope (``q_norm``/``k_norm``, weights [head_dim]) and an explicit ``head_dim``; no q/k/v bias
unless the config sets ``attention_bias``."""

from __future__ import annotations

from dataclasses import replace

from splitserve.models.llama import DecoderArgs, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, config: dict) -> DecoderArgs:
        args = super().parse_config(config)
        return replace(args, qk_norm=True, mlp_bias=False)
