"""The one place where a config becomes stores, a mover and a recovered directory.

The in-process cache, the vLLM connector's worker half and its scheduler half all build theirs here, so that
the same config gives the same stores, thread counts and restart behaviour everywhere. The scheduler half
builds no host slab and no mover (it never touches bytes): it only scans the disk tiers to recover them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

from kvtier.config import KVTierConfig, RedisTierConfig
from kvtier.directory import Directory, Status
from kvtier.metrics import Metrics
from kvtier.mover import Mover, Reporter
from kvtier.sizing import HOST, host_slots, local_tiers, shared_tier
from kvtier.stores.base import LocalStore, SharedStore, Stores
from kvtier.stores.breaker import CircuitBreaker
from kvtier.stores.disk import DiskStore
from kvtier.stores.host import HostSlab

log = logging.getLogger(__name__)
INTEGRITY_REASONS = ("corrupt", "foreign", "symlink")  # what a restart scan removes that counts as a failure


def build_stores(config: KVTierConfig, payload_nbytes: int, namespace: str, rank: int = 0,
                 world_size: int = 1) -> Stores:
    """This rank's stores: its share of the host tier, its folder of each disk tier, its client of Redis."""
    slab = HostSlab(host_slots(config, payload_nbytes, world_size), payload_nbytes)
    stores = Stores(HOST, slab, disk_stores(config, payload_nbytes, namespace, rank))
    shared = shared_tier(config)
    if shared is not None:
        stores.shared[shared[0]] = redis_store(shared[1], namespace, payload_nbytes)
    return stores


def disk_stores(config: KVTierConfig, payload_nbytes: int, namespace: str, rank: int = 0) -> dict[str, LocalStore]:
    return {name: DiskStore(tier.root_dir, namespace, rank, payload_nbytes, o_direct=tier.o_direct)
            for name, tier in local_tiers(config)}


def redis_store(tier: RedisTierConfig, namespace: str, payload_nbytes: int) -> SharedStore:
    from kvtier.stores.redis import RedisStore  # redis-py loads only where a redis tier is configured

    breaker = CircuitBreaker(tier.breaker_failures, tier.breaker_cooldown_s)
    return RedisStore(
        tier.url, namespace, payload_nbytes, tier.max_bytes, key_prefix=tier.key_prefix,
        socket_timeout_s=tier.socket_timeout_s, connect_timeout_s=tier.connect_timeout_s,
        pool_size=tier.pool_size, breaker=breaker, **tier.connection_kwargs(),
    )  # fmt: skip


def build_mover(config: KVTierConfig, stores: Stores, report: Reporter, metrics: Metrics,
                cpus: set[int] | None = None) -> Mover:
    """The mover's pools: the disk tiers' thread counts (the largest, when there are several; 2 and 2 with no
    disk tier), the shared tier's own."""
    local = [tier for _, tier in local_tiers(config)]
    shared = shared_tier(config)
    return Mover(
        stores, report, metrics,
        n_read_threads=max((t.n_read_threads for t in local), default=2),
        n_write_threads=max((t.n_write_threads for t in local), default=2),
        queue_depth=config.queue_depth, cpus=cpus,
        n_shared_read_threads=shared[1].n_read_threads if shared else 1,
        n_shared_write_threads=shared[1].n_write_threads if shared else 1,
    )  # fmt: skip


def recover(directory: Directory, disks: Mapping[str, LocalStore], lock: AbstractContextManager | None = None,
            integrity_failures: Callable[[str, int], None] | None = None) -> None:
    """A restart takes back every valid block the disk tiers still hold (headers only: no payload is read);
    the scan has removed torn, foreign and temp files, and what the directory does not adopt is deleted."""
    lock = lock or nullcontext()
    for name, store in disks.items():
        found, removed = store.scan()
        bad = sum(removed.get(reason, 0) for reason in INTEGRITY_REASONS)
        if bad and integrity_failures is not None:
            integrity_failures(name, bad)
        with lock:
            deletes = directory.adopt(name, [(b.key, b.parent) for b in found])
        for step in deletes:
            store.delete(step.key)
            with lock:
                directory.complete(step, Status.OK)
        if found or any(removed.values()):
            log.info("kvtier: %s tier recovered %d blocks, removed %s", name, len(found), removed)
