"""KV layout sizes: tier budgets are bytes, so a wrong bytes_per_token silently over- or under-fills
every tier. Expected numbers are worked out by hand here, never computed by the code under test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtier.layout import DTYPE_BYTES, PRESETS, KVLayout, preset

CONFIGS = Path(__file__).parent / "data" / "model_configs"


def hf(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# bytes per token, bf16 (2 bytes); standard: layers * 2 (K and V) * kv_heads * head_dim * 2
EXPECTED_BYTES_PER_TOKEN = {
    "llama-3.1-8b": 131072,  # 32 * 2 * 8 * 128 * 2   (head_dim = 4096 / 32)
    "llama-3.1-70b": 327680,  # 80 * 2 * 8 * 128 * 2   (head_dim = 8192 / 64)
    "qwen2.5-7b": 57344,  # 28 * 2 * 4 * 128 * 2   (head_dim = 3584 / 28)
    "qwen2.5-72b": 327680,  # 80 * 2 * 8 * 128 * 2   (head_dim = 8192 / 64)
    "mistral-7b": 131072,  # 32 * 2 * 8 * 128 * 2   (head_dim = 4096 / 32)
    "deepseek-v3": 70272,  # MLA: 61 * (512 + 64) * 2, one latent per layer, no K/V pair
}


def test_every_preset_has_a_config_and_an_expected_size() -> None:
    assert set(PRESETS) == set(EXPECTED_BYTES_PER_TOKEN) == {p.stem for p in CONFIGS.glob("*.json")}


@pytest.mark.parametrize("name", sorted(EXPECTED_BYTES_PER_TOKEN))
def test_preset_matches_published_config(name: str) -> None:
    cfg = hf(name)
    assert cfg["_source"]
    assert preset(name) == KVLayout.from_hf_config(cfg)
    assert preset(name).name == name
    assert preset(name).dtype == "bfloat16"
    assert preset(name).bytes_per_token == EXPECTED_BYTES_PER_TOKEN[name]


def test_deepseek_v3_is_mla_and_far_smaller_than_its_heads_suggest() -> None:
    ds = KVLayout.from_hf_config(hf("deepseek-v3"))
    assert ds.is_mla and ds.mla_latent_dim == 576 and (ds.num_kv_heads, ds.head_dim) == (1, 576)
    # Read as standard attention, its 128 KV heads of 128 + 64 dims would cost 61*2*128*192*2 = 5996544.
    assert ds.bytes_per_token * 85 < 61 * 2 * 128 * 192 * 2


def test_bytes_per_block() -> None:
    assert preset("llama-3.1-8b").bytes_per_block(16) == 2097152  # 16 * 131072 = 2 MiB
    assert preset("llama-3.1-8b").bytes_per_block(256) == 33554432  # 256 * 131072 = 32 MiB
    assert preset("deepseek-v3").bytes_per_block(64) == 4497408  # 64 * 70272
    with pytest.raises(ValueError, match="block_tokens"):
        preset("llama-3.1-8b").bytes_per_block(0)


def test_with_dtype() -> None:
    base = preset("llama-3.1-8b")
    assert base.with_dtype("fp8").bytes_per_token == 65536  # 32 * 2 * 8 * 128 * 1
    assert base.with_dtype("float32").bytes_per_token == 262144  # 32 * 2 * 8 * 128 * 4
    assert base.with_dtype("float8_e5m2").dtype == "float8_e5m2"
    assert preset("deepseek-v3").with_dtype("fp8_e4m3").bytes_per_token == 35136  # 61 * 576 * 1
    assert base.with_dtype("bfloat16") == base
    with pytest.raises(ValueError, match="'int4'"):
        base.with_dtype("int4")


def test_dtype_aliases_collapse_to_one_name() -> None:
    """Equal layouts must give equal namespaces, however the dtype was spelled."""
    spellings = ["bf16", "BFloat16", "torch.bfloat16", "bfloat16"]
    assert len({KVLayout(2, 2, 64, s) for s in spellings}) == 1
    assert KVLayout(2, 2, 64, "half") == KVLayout(2, 2, 64, "fp16") == KVLayout(2, 2, 64, "float16")
    assert KVLayout(2, 2, 64, "fp8") != KVLayout(2, 2, 64, "float8_e5m2")  # same size, different bits
    assert DTYPE_BYTES["fp32"] == 4 and DTYPE_BYTES["half"] == 2 and DTYPE_BYTES["int8"] == 1


def test_shard_splits_kv_heads() -> None:
    llama70 = preset("llama-3.1-70b")  # 8 KV heads
    assert llama70.shard(1) == llama70
    assert llama70.shard(4).num_kv_heads == 2
    assert llama70.shard(8).bytes_per_token == 40960  # 80 * 2 * 1 * 128 * 2 = 327680 / 8


def test_shard_replicates_when_more_ranks_than_kv_heads() -> None:
    qwen7 = preset("qwen2.5-7b")  # 4 KV heads
    assert qwen7.shard(8).num_kv_heads == 1  # each head held by 2 ranks
    assert qwen7.shard(8).bytes_per_token == 14336  # 28 * 2 * 1 * 128 * 2
    assert preset("llama-3.1-70b").shard(16).num_kv_heads == 1


def test_shard_refuses_uneven_split() -> None:
    with pytest.raises(ValueError, match="num_kv_heads=8 and tp_size=3"):
        preset("llama-3.1-8b").shard(3)
    with pytest.raises(ValueError, match="num_kv_heads=4 and tp_size=6"):
        preset("qwen2.5-7b").shard(6)  # 6 > 4 but 6 % 4 != 0
    with pytest.raises(ValueError, match="tp_size"):
        preset("llama-3.1-8b").shard(0)


def test_shard_leaves_mla_latent_whole() -> None:
    ds = preset("deepseek-v3")
    assert ds.shard(8) == ds and ds.shard(8).bytes_per_token == 70272


def test_nested_text_config() -> None:
    """Multimodal configs hold the language model under text_config; the dtype may stay outside."""
    text = {k: v for k, v in hf("llama-3.1-8b").items() if k not in ("_source", "torch_dtype")}
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "torch_dtype": "float16", "text_config": text,
           "vision_config": {"hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 24}}
    assert KVLayout.from_hf_config(cfg) == preset("llama-3.1-8b").with_dtype("float16")
    inner_dtype = {**cfg, "text_config": {**text, "torch_dtype": "bfloat16"}}
    assert KVLayout.from_hf_config(inner_dtype) == preset("llama-3.1-8b")


def test_head_dim_explicit_beats_derived() -> None:
    # Mistral-Nemo-Base-2407 publishes head_dim 128 although hidden 5120 / 32 heads = 160.
    nemo = {"hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 40, "head_dim": 128, "torch_dtype": "bfloat16"}
    assert KVLayout.from_hf_config(nemo).head_dim == 128
    assert KVLayout.from_hf_config(nemo).bytes_per_token == 163840  # 40 * 2 * 8 * 128 * 2
    assert KVLayout.from_hf_config({**nemo, "head_dim": None}).head_dim == 160  # null -> derived
    del nemo["head_dim"]
    assert KVLayout.from_hf_config(nemo).head_dim == 160


def test_config_defaults() -> None:
    mha = {"hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 4}
    layout = KVLayout.from_hf_config(mha)
    assert (layout.num_kv_heads, layout.head_dim, layout.dtype) == (16, 64, "bfloat16")
    assert KVLayout.from_hf_config({**mha, "dtype": "float32"}).dtype == "float32"  # transformers v5 key
    assert KVLayout.from_hf_config({**mha, "torch_dtype": "float32"}, dtype="fp8").dtype == "float8"


@pytest.mark.parametrize("drop", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_missing_key_is_named(drop: str) -> None:
    cfg = {k: v for k, v in hf("llama-3.1-8b").items() if k != drop}
    if drop == "num_attention_heads":
        cfg.pop("num_key_value_heads")  # otherwise it is not needed for the KV heads
    with pytest.raises(ValueError, match=repr(drop)):
        KVLayout.from_hf_config(cfg)


def test_missing_mla_key_is_named() -> None:
    cfg = {k: v for k, v in hf("deepseek-v3").items() if k != "qk_rope_head_dim"}
    with pytest.raises(ValueError, match="'qk_rope_head_dim'"):
        KVLayout.from_hf_config(cfg)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers must be a positive int, got 0"),
        ({"num_kv_heads": -2}, "num_kv_heads must be a positive int, got -2"),
        ({"head_dim": 64.0}, "head_dim must be a positive int, got 64.0"),
        ({"num_layers": True}, "num_layers must be a positive int, got True"),
        ({"dtype": "nf4"}, "unknown dtype 'nf4'"),
        ({"mla_latent_dim": 0}, "mla_latent_dim must be a positive int, got 0"),
        ({"mla_latent_dim": 576}, "MLA layout has num_kv_heads=1"),
    ],
)
def test_bad_fields_are_named(kwargs: dict, message: str) -> None:
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16"} | kwargs
    with pytest.raises(ValueError, match=message):
        KVLayout(**fields)


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(ValueError, match="llama-3.1-8b.*deepseek-v3"):
        preset("llama-4")


def test_layout_is_frozen_and_label_free() -> None:
    a = KVLayout(2, 2, 64, "bf16", name="a")
    assert a == KVLayout(2, 2, 64, "bf16", name="b") and hash(a) == hash(KVLayout(2, 2, 64, "bf16"))
    with pytest.raises(AttributeError):
        a.num_layers = 3


def test_metadata_plane_imports_no_torch() -> None:
    import subprocess

    code = "import sys, kvtier.layout; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
