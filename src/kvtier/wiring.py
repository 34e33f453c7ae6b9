"""The one place where a config becomes stores, a mover and a recovered directory.

The in-process cache, the vLLM connector's worker half and its scheduler half all build theirs here, so that
the same config gives the same stores, thread counts and restart behaviour everywhere. The scheduler half
builds no host slab and no mover (it never touches bytes): it only scans the disk tiers to recover them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

from kvtier.config import KVTierConfig, RedisTierConfig, redact_url
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


def build_stores(config: KVTierConfig, payload_nbytes: int, namespace: str, rank: int, world_size: int,
                 owner: str) -> Stores:
    """This rank's stores: its share of the host tier, its folder of each disk tier, its client of Redis.
    `owner` names the engine: its disk tiers' roots are claimed for it (one engine per root_dir)."""
    slab = HostSlab(host_slots(config, payload_nbytes, world_size), payload_nbytes)
    try:
        local = disk_stores(config, payload_nbytes, namespace, rank, owner)
    except BaseException:
        slab.close()
        raise
    stores = Stores(HOST, slab, local)
    shared = shared_tier(config)
    if shared is not None:
        stores.shared[shared[0]] = redis_store(shared[1], namespace, payload_nbytes, config.auth_key())
        if config.auth_key_env is None and rank == 0:
            log.warning("kvtier: the redis tier at %s is trusted_network: its blocks are not signed, so whoever can "
                        "write to that Redis decides what is served", redact_url(shared[1].url))
    return stores


def disk_stores(config: KVTierConfig, payload_nbytes: int, namespace: str, rank: int,
                owner: str) -> dict[str, LocalStore]:
    stores: dict[str, LocalStore] = {}
    try:
        for name, tier in local_tiers(config):
            stores[name] = DiskStore(tier.root_dir, namespace, rank, payload_nbytes, o_direct=tier.o_direct,
                                     owner=owner, auth_key=config.auth_key(), max_bytes=tier.max_bytes)
    except BaseException:  # a root another engine holds: give back what was claimed
        for store in stores.values():
            store.close()
        raise
    return stores


def redis_store(tier: RedisTierConfig, namespace: str, payload_nbytes: int,
                auth_key: bytes | None = None) -> SharedStore:
    # redis-py loads only where a redis tier is configured
    from kvtier.stores.redis import RedisStore
    from kvtier.stores.redis_cluster import RedisClusterStore

    breaker = CircuitBreaker(tier.breaker_failures, tier.breaker_cooldown_s)
    common = dict(key_prefix=tier.key_prefix, socket_timeout_s=tier.socket_timeout_s,
                  connect_timeout_s=tier.connect_timeout_s, pool_size=tier.pool_size, breaker=breaker,
                  auth_key=auth_key, oom_cap_s=tier.oom_cap_s, **tier.connection_kwargs())
    if tier.cluster:
        return RedisClusterStore(tier.url, namespace, payload_nbytes, tier.max_bytes, tier.partitions, **common)
    store = RedisStore(tier.url, namespace, payload_nbytes, tier.max_bytes, **common)
    if store.cluster_enabled():
        store.close()
        raise ValueError(f"redis tier url {redact_url(tier.url)}: a Redis Cluster node (cluster_enabled:1); set "
                         '"cluster": true on the tier to use the cluster (docs/scaling.md)')
    return store


def build_mover(config: KVTierConfig, stores: Stores, report: Reporter, metrics: Metrics,
                cpus: set[int] | None = None) -> Mover:
    """The mover's pools: each disk tier's reads on its own, the writes on the disk tiers' largest count (2 and 2
    with no disk tier), the shared tier's own; each tier's load deadline."""
    local = local_tiers(config)
    shared = shared_tier(config)
    timeouts = {name: t.load_timeout_s for name, t in local} | ({shared[0]: shared[1].load_timeout_s} if shared else {})
    return Mover(
        stores, report, metrics,
        n_read_threads=max((t.n_read_threads for _, t in local), default=2),
        n_write_threads=max((t.n_write_threads for _, t in local), default=2),
        queue_depth=config.queue_depth, cpus=cpus,
        n_shared_read_threads=shared[1].n_read_threads if shared else 1,
        n_shared_write_threads=shared[1].n_write_threads if shared else 1,
        read_threads={name: t.n_read_threads for name, t in local},
        load_timeouts=timeouts,
    )


def recover(directory: Directory, ranks: Sequence[Mapping[str, LocalStore]], lock: AbstractContextManager | None = None,
            integrity_failures: Callable[[str, int], None] | None = None) -> None:
    """A restart takes back every valid block the disk tiers still hold (headers only: no payload is read).

    `ranks[r]` are rank r's disk stores by tier name: one directory serves all ranks, so a block comes back only
    if every rank has its shard (with the same parent); the other ranks' shards of it are deleted. The scans
    have removed torn, foreign and temp files; what the directory does not adopt is deleted on every rank.
    First, the folders of other namespaces (what this engine served before a change of weights, dtype, world
    size, salt or key) are removed: no one can read them (one engine per root), and no bound counts them.
    """
    lock = lock or nullcontext()
    for name in ranks[0]:
        gone = ranks[0][name].remove_other_namespaces({stores[name].namespace for stores in ranks})
        if gone:
            log.info("kvtier: %s tier: removed the blocks of %d other namespace(s), which this engine cannot read",
                     name, len(gone))
        scans = [stores[name].scan() for stores in ranks]
        bad = sum(removed.get(reason, 0) for _, removed in scans for reason in INTEGRITY_REASONS)
        if bad and integrity_failures is not None:
            integrity_failures(name, bad)
        found = [{b.key: b.parent for b in blocks} for blocks, _ in scans]
        whole = [b for b in scans[0][0] if all(shards.get(b.key, b"") == b.parent for shards in found[1:])]
        kept = {b.key for b in whole}
        for stores, shards in zip(ranks, found):
            for key in shards.keys() - kept:  # a block some rank lacks: no rank can serve it
                _delete(stores[name], key)
        with lock:
            deletes = directory.adopt(name, [(b.key, b.parent) for b in whole])
        for step in deletes:
            ok = all([_delete(stores[step.src], step.key) for stores in ranks])
            with lock:
                directory.complete(step, Status.OK if ok else Status.FAILED)
        if any(blocks or any(removed.values()) for blocks, removed in scans):
            log.info("kvtier: %s tier recovered %d blocks on %d rank(s), removed %s", name,
                     directory.tier[name].used_blocks, len(ranks), [removed for _, removed in scans])


def _delete(store: LocalStore, key: bytes) -> bool:
    """A restart's delete; one that fails leaves its file, which the directory keeps counting."""
    try:
        store.delete(key)
        return True
    except OSError as exc:
        log.warning("kvtier: could not delete a block file at restart: %s", exc)
        return False
