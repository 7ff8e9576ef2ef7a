"""Qwen2 / Qwen2.5: the Llama decoder (``llama.py``) with a bias on the q, k and v projections
(none on o_proj or the MLP)."""

from __future__ import annotations

from dataclasses import replace

from splitserve.models.llama import DecoderArgs, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, config: dict) -> DecoderArgs:
        args = super().parse_config(config)
        return replace(args, qkv_bias=True, o_bias=False, mlp_bias=False)
