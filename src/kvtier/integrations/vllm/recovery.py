"""A restart of the engine takes back what the disk tiers of every rank hold (headers only: no payload read)."""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.directory import Directory
from kvtier.integrations.vllm.setup import Geometry
from kvtier.wiring import disk_stores, recover


def recover_ranks(config: KVTierConfig, geometry: Geometry, directory: Directory) -> None:
    """One directory serves every rank: a block comes back only if every rank's disk holds its shard."""
    ranks = [disk_stores(config, geometry.block_nbytes, geometry.namespace(rank), rank, geometry.owner)
             for rank in range(geometry.world_size)]
    try:
        recover(directory, ranks)
    finally:
        for disks in ranks:
            for store in disks.values():
                store.close()

