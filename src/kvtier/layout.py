"""What a block is and how big it is, in memory and in each tier.

A `KVLayout` describes the KV cache of one model as one worker holds it: layers, KV heads, head size and
element type. Tier capacities are set in bytes but decisions are made in blocks, so every tier needs
`bytes_per_block`; and the layout is part of the namespace, because bytes written for one layout are
garbage for another. What a block costs a tier beyond its payload (alignment, the disk header) is here too,
so that the stores and the directory's sizing count the same bytes. Imports nothing of kvtier: no torch, no
vLLM (dtypes are handled by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Every accepted spelling -> its canonical name. Aliases collapse so that "bf16" and "bfloat16" give
# equal layouts (and so equal namespaces); the fp8 variants stay distinct because their bits differ.
_CANONICAL: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float8": "float8", "fp8": "float8",
    "float8_e4m3fn": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",  # vLLM's kv_cache_dtype spelling
    "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1,
          "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
DTYPE_BYTES: dict[str, int] = {alias: _BYTES[name] for alias, name in _CANONICAL.items()}


def canonical_dtype(dtype: str) -> str:
    """'bf16', 'BFloat16' or 'torch.bfloat16' -> 'bfloat16'; ValueError naming anything unknown."""
    key = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if key not in _CANONICAL:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_CANONICAL))}")
    return _CANONICAL[key]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype given by name."""
    return _BYTES[canonical_dtype(dtype)]


ALIGN = 4096  # page size and the O_DIRECT alignment: host slots and disk payloads start on it
DISK_HEADER_NBYTES = ALIGN  # a disk block's self-checking header, zero-padded to the alignment


def round_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of `align` that is >= n."""
    return -(-n // align) * align


def disk_footprint(payload_nbytes: int) -> int:
    """Bytes one block occupies on disk: its header and its payload padded to the alignment."""
    return DISK_HEADER_NBYTES + round_up(payload_nbytes)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVLayout:
    """The KV cache shape of one model (or of one tensor-parallel shard of it).

    Standard attention caches a K and a V vector per KV head, per layer, per token. MLA models
    (DeepSeek-V2/V3) cache one latent vector per layer per token instead (`mla_latent_dim` =
    kv_lora_rank + qk_rope_head_dim), with no K/V pair and no heads; such a layout is written as
    `num_kv_heads=1, head_dim=mla_latent_dim`, the shape vLLM gives it, so that it has one spelling only.
    `name` is a label: it takes no part in equality, since two equal shapes hold interchangeable bytes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    mla_latent_dim: int | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_positive("num_layers", self.num_layers)
        _check_positive("num_kv_heads", self.num_kv_heads)
        _check_positive("head_dim", self.head_dim)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.mla_latent_dim is not None:
            _check_positive("mla_latent_dim", self.mla_latent_dim)
            if (self.num_kv_heads, self.head_dim) != (1, self.mla_latent_dim):
                raise ValueError(
                    f"an MLA layout has num_kv_heads=1 and head_dim=mla_latent_dim={self.mla_latent_dim}, "
                    f"got num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                )

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim is not None

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers of this layout."""
        if self.mla_latent_dim is not None:
            return self.num_layers * self.mla_latent_dim * dtype_bytes(self.dtype)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    def bytes_per_block(self, block_tokens: int) -> int:
        """Bytes of one block of `block_tokens` tokens: the unit every tier budgets in."""
        _check_positive("block_tokens", block_tokens)
        return block_tokens * self.bytes_per_token

    def with_dtype(self, dtype: str) -> KVLayout:
        """The same shape stored in another dtype (e.g. an fp8 KV cache of a bf16 model)."""
        return replace(self, dtype=dtype)

    def shard(self, tp_size: int) -> KVLayout:
        """The layout one tensor-parallel rank holds.

        KV heads are split across ranks; when there are more ranks than KV heads, vLLM replicates each
        head on tp/heads ranks, so every rank holds one. The MLA latent is replicated on every rank.
        """
        _check_positive("tp_size", tp_size)
        if self.is_mla:
            return self
        heads = self.num_kv_heads
        if heads % tp_size == 0:
            return replace(self, num_kv_heads=heads // tp_size)
        if tp_size % heads == 0:
            return replace(self, num_kv_heads=1)
        raise ValueError(f"num_kv_heads={heads} and tp_size={tp_size}: neither divides the other")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], dtype: str | None = None) -> KVLayout:
        """Read a HuggingFace `config.json` dict. `dtype` overrides the config's own.

        Multimodal configs keep the language model under `text_config`; its keys win over the top
        level's (which may still hold the dtype).
        """
        text = cfg.get("text_config")
        c = {**cfg, **text} if isinstance(text, dict) else cfg

        def need(key: str) -> Any:
            if c.get(key) is None:
                raise ValueError(f"HF config is missing required key {key!r}")
            return c[key]

        name = str(c.get("_name_or_path") or "")
        dtype = dtype or c.get("dtype") or c.get("torch_dtype") or "bfloat16"
        num_layers = need("num_hidden_layers")
        if c.get("kv_lora_rank") is not None:
            latent = need("kv_lora_rank") + need("qk_rope_head_dim")
            return cls(num_layers, 1, latent, dtype, mla_latent_dim=latent, name=name)
        heads = c.get("num_key_value_heads")
        if heads is None:
            heads = need("num_attention_heads")
        head_dim = c.get("head_dim")
        if head_dim is None:
            head_dim = need("hidden_size") // need("num_attention_heads")
        return cls(num_layers, heads, head_dim, dtype, name=name)


# Published HuggingFace config.json values (see tests/data/model_configs/ for each source), bf16.
PRESETS: dict[str, KVLayout] = {
    p.name: p
    for p in (
        KVLayout(32, 8, 128, "bfloat16", name="llama-3.1-8b"),  # hidden 4096 / 32 heads = 128
        KVLayout(80, 8, 128, "bfloat16", name="llama-3.1-70b"),  # hidden 8192 / 64 heads = 128
        KVLayout(28, 4, 128, "bfloat16", name="qwen2.5-7b"),  # hidden 3584 / 28 heads = 128
        KVLayout(80, 8, 128, "bfloat16", name="qwen2.5-72b"),  # hidden 8192 / 64 heads = 128
        KVLayout(32, 8, 128, "bfloat16", name="mistral-7b"),  # hidden 4096 / 32 heads = 128
        KVLayout(61, 1, 576, "bfloat16", mla_latent_dim=576, name="deepseek-v3"),  # 512 + 64
    )
}


def preset(name: str) -> KVLayout:
    """A known model's layout by preset name."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown layout preset {name!r}; known: {', '.join(PRESETS)}") from None
