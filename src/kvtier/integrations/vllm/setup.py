"""What a kvtier block is inside one vLLM engine: its tokens, its bytes, its namespace."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import ConfigError, KVTierConfig, for_engine
from kvtier.keys import Namespace
from kvtier.weights import NoWeights, hub_snapshot, weights_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Geometry:
    engine_block_size: int  # tokens per vLLM block
    block_tokens: int  # tokens per kvtier block (a multiple of the engine's)
    engine_block_nbytes: int  # one vLLM block, all layers of this worker's shard
    world_size: int
    model: str
    dtype: str
    kv_layout: str
    hash_algo: str
    tenant_salt: str
    auth: str = ""  # KVTierConfig.auth_fingerprint
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # vLLM's instance id: all its processes know it

    @property
    def owner(self) -> str:
        """Whom this engine's disk tiers are claimed for (one engine per root_dir)."""
        return f"vllm-{self.engine_id}"

    @property
    def engine_blocks_per_block(self) -> int:
        return self.block_tokens // self.engine_block_size

    @property
    def block_nbytes(self) -> int:
        return self.engine_blocks_per_block * self.engine_block_nbytes

    def namespace(self, rank: int) -> str:
        return Namespace(
            model=self.model, dtype=self.dtype, block_size=self.block_tokens, kv_layout=self.kv_layout,
            rank=rank, world_size=self.world_size, hash_algo=self.hash_algo, tenant_salt=self.tenant_salt,
            auth=self.auth,
        ).digest()


def read_config(vllm_config: VllmConfig) -> KVTierConfig:
    """kvtier's config from `kv_connector_extra_config`, with the engine's block size filled in."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None, "the connector is built from a kv_transfer_config"
    return for_engine(transfer.kv_connector_extra_config or {}, vllm_config.cache_config.block_size)


def geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTierConfig) -> Geometry:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"kvtier supports models with one KV-cache group; this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    engine_id = str(getattr(vllm_config, "instance_id", "") or uuid.uuid4().hex)
    return Geometry(
        engine_block_size=vllm_config.cache_config.block_size,
        block_tokens=config.block_size,
        engine_block_nbytes=spec.page_size_bytes * len(groups[0].layer_names),
        world_size=vllm_config.parallel_config.world_size,
        model=_weights(vllm_config, engine_id),
        dtype=str(vllm_config.cache_config.cache_dtype) + "/" + str(vllm_config.model_config.dtype),
        kv_layout=str(kv_cache_config.kv_cache_layout or type(spec).__name__),
        hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        tenant_salt=config.tenant_salt,
        auth=config.auth_fingerprint(),
        engine_id=engine_id,
    )


def _weights(vllm_config: VllmConfig, engine_id: str) -> str:
    """The identity of the weights the engine serves (kvtier.weights): every byte of the files it loaded, found in
    the model's folder or, for a hub id, in the hub cache's snapshot. Weights in no folder kvtier can read (another
    loader, a moved revision) get an identity of this engine's own: its disk and Redis blocks are then shared with
    no other engine, and kept across no restart."""
    model_config = vllm_config.model_config
    hf_config = getattr(model_config, "hf_config", None)
    to_dict = getattr(hf_config, "to_dict", None)
    config = to_dict() if callable(to_dict) else {}
    folder = weights_folder(model_config, vllm_config.load_config)
    if folder is not None:
        try:
            return weights_identity(folder, config, getattr(model_config, "quantization", None))
        except NoWeights:
            pass
    log.warning("kvtier: no local weight files of %r were found (a hub id is looked up in the hub cache's snapshot "
                "it was loaded from): the disk and redis tiers keep this engine's blocks to this engine",
                str(model_config.model))
    return f"unidentified:{model_config.model}:{engine_id}"


def weights_folder(model_config: Any, load_config: Any) -> Path | None:
    """The folder vLLM loaded the weights from: the model itself when it is a folder, else the snapshot of the hub
    cache (its download_dir, or HF_HUB_CACHE) at the model's revision and its config's commit. Nothing is asked of
    the hub."""
    model = str(model_config.model)
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import constants  # vLLM's own dependency: where it downloaded the model to

    cache = getattr(load_config, "download_dir", None) or constants.HF_HUB_CACHE
    commit = getattr(getattr(model_config, "hf_config", None), "_commit_hash", None)
    return hub_snapshot(model, getattr(model_config, "revision", None), Path(cache), commit)
