"""From a config to the directory's tier specs: one place, so the in-process cache and the vLLM scheduler
size their tiers the same way. Metadata only: no torch, no files."""

from __future__ import annotations

from kvtier.admission import AdmissionRule
from kvtier.config import AdmissionConfig, KVTierConfig
from kvtier.directory import TierSpec

ALIGN = 4096  # page size and the O_DIRECT alignment: host slots and disk payloads start on it
DISK_HEADER_NBYTES = ALIGN
HOST = "host"


def round_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of `align` that is >= n."""
    return -(-n // align) * align


def disk_footprint(payload_nbytes: int) -> int:
    """Bytes one block occupies on disk: its header and its payload padded to the alignment."""
    return DISK_HEADER_NBYTES + round_up(payload_nbytes)


def host_slots(config: KVTierConfig, payload_nbytes: int, world_size: int = 1) -> int:
    """Slots of this rank's host slab; `cpu_bytes_to_use` is the total across ranks, as in vLLM."""
    slots = config.cpu_bytes_to_use // world_size // round_up(payload_nbytes)
    if slots < 1:
        raise ValueError(
            f"cpu_bytes_to_use={config.cpu_bytes_to_use} holds no block of {round_up(payload_nbytes)} B per rank"
            f" (world size {world_size})"
        )
    return slots


def tier_names(config: KVTierConfig) -> list[str]:
    return [HOST] + ["disk" if i == 0 else f"disk{i}" for i in range(len(config.secondary_tiers))]


def _rule(admission: AdmissionConfig) -> AdmissionRule:
    return AdmissionRule(admission.min_priority, admission.min_sightings, admission.max_write_bytes_per_s)


def tier_specs(config: KVTierConfig, payload_nbytes: int, world_size: int = 1) -> list[TierSpec]:
    slots = host_slots(config, payload_nbytes, world_size)
    specs = [TierSpec(HOST, slots * round_up(payload_nbytes), round_up(payload_nbytes), slotted=True,
                      policy=config.eviction_policy, admission=_rule(config.host_admission))]
    for name, tier in zip(tier_names(config)[1:], config.secondary_tiers):
        specs.append(TierSpec(name, tier.max_bytes, disk_footprint(payload_nbytes), policy=tier.eviction_policy,
                              admission=_rule(tier.admission), write_through=tier.write_policy == "write_through"))
    return specs
