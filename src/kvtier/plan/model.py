"""A model as the budget sees it: parameters and their bytes, the KV layout, and what prefill costs.

Read from a preset or from any HuggingFace `config.json`. Parameters are counted from the architecture keys:
embeddings, each decoder layer's attention (grouped-query, with Qwen2's q/k/v biases, or DeepSeek's MLA), its
MLP (gated; dense, or mixture-of-experts with shared experts and a router) and norms, and the LM head unless it is
tied. DeepSeek-V3's multi-token-prediction layer is not counted: vLLM loads it only for speculative decoding.
Quantized checkpoints store the decoder layers' matrices in the quantized type; embeddings, the LM head and the
norms stay in the model's dtype (the scales of block-quantized fp8 are under 0.01% and not counted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.layout import KVLayout, canonical_dtype, dtype_bytes
from kvtier.plan.presets import MODEL_CONFIGS

# Bytes per weight of a quantization method's stored matrices when its config does not say `bits`.
_QUANT_BYTES = {"fp8": 1.0, "fbgemm_fp8": 1.0, "compressed-tensors": 1.0, "bitsandbytes": 0.5}
WEIGHT_DTYPES = {"bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0, "fp32": 4.0, "float32": 4.0,
                 "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class Parameters:
    embeddings: int  # input embeddings and (untied) LM head: stay in the model's dtype when quantized
    layers: int  # the decoder layers' matrices: what quantization shrinks
    norms: int
    active: int  # parameters one token passes through (MoE: the routed experts it uses, not all of them)

    @property
    def total(self) -> int:
        return self.embeddings + self.layers + self.norms


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: dict[str, Any]  # the text model's keys
    params: Parameters
    layout: KVLayout  # the whole model's KV, in the KV dtype
    weight_bytes_per_param: float  # of the decoder layers' matrices
    dtype: str  # the model's own dtype: embeddings, norms, activations

    @property
    def weight_bytes(self) -> int:
        p, own = self.params, dtype_bytes(self.dtype)
        return int(p.layers * self.weight_bytes_per_param) + (p.embeddings + p.norms) * own

    @property
    def hidden(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]

    @property
    def mlp_width(self) -> int:
        """The widest MLP activation one token makes (MoE: all the experts it is routed to, and the shared)."""
        c = self.config
        dense = c.get("intermediate_size") or 4 * self.hidden
        experts = _experts(c)
        if not experts:
            return dense
        per_expert = c.get("moe_intermediate_size") or dense
        shared = (c.get("n_shared_experts") or 0) * per_expert + (c.get("shared_expert_intermediate_size") or 0)
        return max(dense, (c.get("num_experts_per_tok") or 1) * per_expert + shared)

    @property
    def max_position_embeddings(self) -> int | None:
        return self.config.get("max_position_embeddings")

    def attention_pair_flops(self) -> float:
        """Attention FLOPs per (query, key) pair per layer: 2 * heads * (q.k width + v width)."""
        c = self.config
        heads = c["num_attention_heads"]
        if c.get("kv_lora_rank") is not None:
            return 2 * heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
        head_dim = c.get("head_dim") or self.hidden // heads
        return 2 * heads * 2 * head_dim


def load_model(model: str, weight_dtype: str | None = None, kv_dtype: str | None = None) -> ModelSpec:
    """`model`: a preset name, a `config.json` file, or a folder holding one. ValueError names what is wrong."""
    path = Path(model)
    if model in MODEL_CONFIGS:
        name, raw = model, MODEL_CONFIGS[model]
    elif path.suffix == ".json" or path.exists():
        file = path / "config.json" if path.is_dir() else path
        name, raw = str(path), _read_json(file)
    else:
        raise ValueError(f"--model {model!r}: not a preset ({', '.join(MODEL_CONFIGS)}), a config.json file or a "
                         "folder holding one")
    return model_from_config(raw, name, weight_dtype, kv_dtype, source=name)


def model_from_config(raw: dict[str, Any], name: str, weight_dtype: str | None = None, kv_dtype: str | None = None,
                      source: str = "config") -> ModelSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    text = raw.get("text_config")
    c = {**raw, **text} if isinstance(text, dict) else dict(raw)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = c.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{source}: key {key!r} must be a positive int, got {value!r}")
    try:
        dtype = canonical_dtype(str(c.get("dtype") or c.get("torch_dtype") or "bfloat16"))
        layout = replace(KVLayout.from_hf_config(c, dtype=dtype if kv_dtype in (None, "auto") else kv_dtype),
                         name=name)
        params = count_parameters(c)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: cannot count the model's parameters: missing or malformed key {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return ModelSpec(name, c, params, layout, _weight_bytes_per_param(c, weight_dtype, dtype, source), dtype)


def count_parameters(c: dict[str, Any]) -> Parameters:
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
    attention, attention_norms = _attention(c)
    dense_mlp = 3 * hidden * (c.get("intermediate_size") or 4 * hidden)
    experts = _experts(c)
    norms = hidden + layers * (2 * hidden + attention_norms)
    if not experts:
        per_layer = attention + dense_mlp
        return Parameters(embeddings, layers * per_layer, norms, embeddings + layers * per_layer + norms)
    expert = 3 * hidden * (c.get("moe_intermediate_size") or c["intermediate_size"])
    shared = (c.get("n_shared_experts") or 0) * expert + 3 * hidden * (c.get("shared_expert_intermediate_size") or 0)
    router = hidden * experts + (experts if c.get("topk_method") == "noaux_tc" else 0)
    moe = experts * expert + shared + router
    dense_layers = min(layers, c.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_layers
    total_layers = layers * attention + dense_layers * dense_mlp + moe_layers * moe
    idle_experts = moe_layers * (experts - (c.get("num_experts_per_tok") or 1)) * expert
    return Parameters(embeddings, total_layers, norms, embeddings + total_layers + norms - idle_experts)


def _attention(c: dict[str, Any]) -> tuple[int, int]:
    """One layer's attention parameters, and its norms beyond the two every layer has."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank") is not None:  # MLA: low-rank queries (or a plain projection), a shared latent
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q_rank = c.get("q_lora_rank")
        q = hidden * heads * qk if q_rank is None else hidden * q_rank + q_rank * heads * qk
        kv = hidden * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) \
            + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv + heads * c["v_head_dim"] * hidden, c["kv_lora_rank"] + (q_rank or 0)
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe"))
    return hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if bias else 0), 0


def _experts(c: dict[str, Any]) -> int:
    return c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0


def _weight_bytes_per_param(c: dict[str, Any], weight_dtype: str | None, dtype: str, source: str) -> float:
    if weight_dtype is not None:
        if weight_dtype.lower() not in WEIGHT_DTYPES:
            raise ValueError(f"--weight-dtype {weight_dtype!r}: known: {', '.join(WEIGHT_DTYPES)}")
        return WEIGHT_DTYPES[weight_dtype.lower()]
    quant = c.get("quantization_config")
    if isinstance(quant, dict):
        if isinstance(quant.get("bits"), int):
            return quant["bits"] / 8
        method = str(quant.get("quant_method", ""))
        if method in _QUANT_BYTES:
            return _QUANT_BYTES[method]
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} without `bits`: pass "
                         "--weight-dtype")
    return float(dtype_bytes(dtype))


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except OSError as exc:
        raise ValueError(f"{file}: cannot read model config ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
