"""A tiny Llama with random weights, built locally: the demo and the tests never download a model."""

from __future__ import annotations

from pathlib import Path


def build_tiny_llama(path: str | Path, layers: int = 4, seed: int = 0, init_scale: float = 0.2) -> str:
    """`init_scale` (HF's initializer_range, 0.02 by default) is large so that the next-token distribution is
    peaked: greedy outputs then do not flip on last-bit differences between equally valid kernel paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, initializer_range=init_scale)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).eval().save_pretrained(path)
    return str(path)
