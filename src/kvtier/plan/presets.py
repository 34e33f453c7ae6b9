"""The architecture keys of each preset's published HuggingFace `config.json`: what counting weights and KV needs.

The same names as `kvtier.layout.PRESETS` (a test checks that both give the same KV layout). Only the keys the
counts read are kept; the values are the published configs'.
"""

from __future__ import annotations

from typing import Any

_LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {**_LLAMA_8B, "max_position_embeddings": 131072},
    "llama-3-8b": {**_LLAMA_8B, "max_position_embeddings": 8192},  # the same weights' shapes, 8k context
    "llama-3.1-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                      "tie_word_embeddings": False, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
    "qwen2.5-72b": {"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                   "tie_word_embeddings": False, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "topk_method": "noaux_tc", "num_attention_heads": 128, "num_key_value_heads": 128,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
                    "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
                    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
}

# What `vllm serve` takes for each preset: the published checkpoint's hub id.
HUB_IDS: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct", "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct", "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
}
