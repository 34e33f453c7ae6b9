"""The tiny engine the demo, the bench and the tests run: a random-weight Llama built locally (nothing is
downloaded), served by vLLM on the CPU with a small KV budget."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def build_tiny_llama(path: str | Path, layers: int = 4, seed: int = 0, init_scale: float = 0.2,
                     tokenizer: bool = False) -> str:
    """`init_scale` (HF's initializer_range, 0.02 by default) is large so that the next-token distribution is
    peaked: greedy outputs then do not flip on last-bit differences between equally valid kernel paths.
    `tokenizer`: also train and save its tokenizer (`tiny_tokenizer`), for text clients."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, initializer_range=init_scale)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)  # transformers' stubs type `.to` for devices only
    model.to(torch.bfloat16).eval().save_pretrained(path)
    if tokenizer:
        from kvtier.integrations.vllm.tiny_tokenizer import build_tokenizer

        build_tokenizer(path)
    return str(path)


ENGINE_BLOCK_TOKENS = 128  # vLLM's block size on the CPU backend
ENGINE_BLOCKS = 48  # 6,144 tokens of engine KV, a few requests' worth: the cache is under pressure


def start_engine(model: str, kvtier_config: dict | None, max_num_seqs: int = 4, engine_blocks: int = ENGINE_BLOCKS,
                 **engine_args: Any) -> Any:
    """A vLLM engine on the CPU, in this process, with a deliberately small KV budget (`engine_blocks`); kvtier's
    connector when `kvtier_config` (its `kv_connector_extra_config`) is given, vLLM's prefix cache alone
    otherwise. `engine_args` go to vLLM as they are."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    kv = None if kvtier_config is None else {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": kvtier_config}
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=4096, dtype="bfloat16",
               seed=0, max_num_seqs=max_num_seqs, enable_prefix_caching=True, num_gpu_blocks_override=engine_blocks,
               kv_transfer_config=kv, disable_log_stats=False, **engine_args)
