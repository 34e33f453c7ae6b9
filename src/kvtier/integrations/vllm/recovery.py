"""A restart of the engine takes back what the disk tiers of every rank hold (headers only: no payload read).

The scan runs in the scheduler's process, on the scheduler's file system. A rank whose worker runs on another
machine (tensor parallelism across nodes) keeps its files where the scan cannot see them: they would never be
adopted nor bounded, and rank 0's blocks would be deleted for lacking that rank's shard. So a disk tier needs
every rank's folder where the scheduler runs (one node, or a root_dir on a file system all nodes share, with
working locks): each worker's store holds a lock in its folder (`kvtier.stores.claim.hold_rank`), and a start
where some rank's folder is not held here is refused, naming the tier and the ranks.
"""

from __future__ import annotations

from kvtier.config import ConfigError, FsTierConfig, KVTierConfig
from kvtier.directory import Directory
from kvtier.integrations.vllm.setup import Geometry
from kvtier.stores.disk import rank_visible
from kvtier.wiring import disk_stores, recover


def recover_ranks(config: KVTierConfig, geometry: Geometry, directory: Directory) -> None:
    """One directory serves every rank: a block comes back only if every rank's disk holds its shard."""
    check_ranks_visible(config, geometry)
    ranks = [disk_stores(config, geometry.block_nbytes, geometry.namespace(rank), rank, geometry.owner)
             for rank in range(geometry.world_size)]
    try:
        recover(directory, ranks)
    finally:
        for disks in ranks:
            for store in disks.values():
                store.close()


def check_ranks_visible(config: KVTierConfig, geometry: Geometry) -> None:
    """Refuse a disk tier some rank's worker keeps out of this process's sight (vLLM builds the workers' stores
    before the scheduler: each holds its rank's folder by then)."""
    for where, (name, tier) in enumerate(zip(config.tier_names()[1:], config.secondary_tiers)):
        if not isinstance(tier, FsTierConfig):
            continue
        unseen = [r for r in range(geometry.world_size) if not rank_visible(tier.root_dir, geometry.namespace(r), r)]
        if unseen:
            raise ConfigError(
                f"secondary_tiers[{where}].root_dir: the {name} tier's folder of rank(s) {unseen} under "
                f"{tier.root_dir} is not open on this machine: their workers run on another node (tensor "
                "parallelism across nodes). The restart scan runs where the scheduler does and could neither "
                "recover nor bound their files. A disk tier needs every rank on the scheduler's node, or a root_dir "
                "on a file system every node mounts at that path (with working locks); else drop the fs tier "
                "(host and redis tiers work across nodes).")
