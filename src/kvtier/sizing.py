"""From a config to the tiers the directory sees: one place, so that the in-process cache, the vLLM scheduler
and the simulator size their tiers the same way. Metadata only: no torch, no files.

Tiers are *local* (host, then each `fs` tier: "disk", "disk1", ...; the directory owns their contents) or
*shared* (the one `redis` tier, named "redis": other engines change it, so its store keeps its contents and
bytes, and the directory only plans writes to it and fetches from it; see `SharedSpec`).
"""

from __future__ import annotations

import logging

from kvtier.admission import AdmissionRule
from kvtier.config import HOST, AdmissionConfig, DiskAdmissionConfig, FsTierConfig, KVTierConfig, RedisTierConfig
from kvtier.directory import SharedSpec, TierSpec
from kvtier.layout import disk_footprint, round_up
from kvtier.stores.base import TierKind
from kvtier.stores.blockformat import HEADER_NBYTES as SHARED_HEADER_NBYTES

log = logging.getLogger(__name__)


def host_slots(config: KVTierConfig, payload_nbytes: int, world_size: int = 1) -> int:
    """Slots of this rank's host slab; `cpu_bytes_to_use` is the total across ranks, as in vLLM."""
    slots = config.cpu_bytes_to_use // world_size // round_up(payload_nbytes)
    if slots < 1:
        raise ValueError(
            f"cpu_bytes_to_use={config.cpu_bytes_to_use} holds no block of {round_up(payload_nbytes)} B per rank"
            f" (world size {world_size})"
        )
    return slots


def shared_footprint(payload_nbytes: int) -> int:
    """Bytes one block counts against a shared tier's max_bytes: its (unpadded) header and its payload."""
    return SHARED_HEADER_NBYTES + payload_nbytes


def local_tiers(config: KVTierConfig) -> list[tuple[str, FsTierConfig]]:
    """The fs tiers with their names, fastest (first configured) first."""
    return [(n, t) for n, t in zip(config.tier_names()[1:], config.secondary_tiers) if isinstance(t, FsTierConfig)]


def shared_tier(config: KVTierConfig) -> tuple[str, RedisTierConfig] | None:
    """The shared tier with its name, if one is configured."""
    shared = [(n, t) for n, t in zip(config.tier_names()[1:], config.secondary_tiers) if isinstance(t, RedisTierConfig)]
    if len(shared) > 1:
        raise ValueError(f"at most one redis tier is supported, the config has {len(shared)}")
    return shared[0] if shared else None


def route_blocks(config: KVTierConfig) -> int:
    """How many leading blocks of a chain pick its partition of a clustered shared tier (`keys.chain_route`):
    its `partition_tokens`, rounded up to whole blocks; 0 without a cluster (one partition, no route)."""
    shared = shared_tier(config)
    if shared is None or not shared[1].cluster:
        return 0
    return -(-shared[1].partition_tokens // config.block_size)


def _rule(admission: AdmissionConfig | DiskAdmissionConfig) -> AdmissionRule:
    auto = admission.min_sightings == "auto"
    return AdmissionRule(admission.min_priority, 2 if auto else int(admission.min_sightings),
                         admission.max_write_bytes_per_s, adaptive=auto)


def tier_specs(config: KVTierConfig, payload_nbytes: int, world_size: int = 1) -> list[TierSpec]:
    """The local tiers, as the directory sees them (a shared tier is `shared_spec`)."""
    slots = host_slots(config, payload_nbytes, world_size)
    specs = [TierSpec(HOST, slots * round_up(payload_nbytes), round_up(payload_nbytes), kind=TierKind.HOST,
                      policy=config.eviction_policy, admission=_rule(config.host_admission))]
    for name, tier in local_tiers(config):
        specs.append(TierSpec(name, tier.max_bytes, disk_footprint(payload_nbytes), kind=TierKind.DISK,
                              policy=tier.eviction_policy, admission=_rule(tier.admission),
                              write_through=tier.write_policy == "write_through"))
    return specs


def shared_spec(config: KVTierConfig, payload_nbytes: int) -> SharedSpec | None:
    """The shared tier as the directory sees it, or None. Its `max_bytes` is the store's business."""
    found = shared_tier(config)
    if found is None:
        return None
    name, tier = found
    if "write_policy" in tier.model_fields_set and tier.write_policy == "write_back":
        log.warning("kvtier: the redis tier is always written through from host; write_policy=write_back is ignored")
    if tier.max_bytes < shared_footprint(payload_nbytes):
        need = shared_footprint(payload_nbytes)
        raise ValueError(f"redis tier: max_bytes={tier.max_bytes} holds no block of {need} B")
    return SharedSpec(name, shared_footprint(payload_nbytes), _rule(tier.admission))

