"""Bounds and leaks ("Trust, second round"): every tier within its bytes, even across a stop and a namespace
change; every queue bounded; every step of every plan reported, whatever raises; nothing kept for a block no tier
holds. Each test drives the real halves of the connector (`tests.connector_harness`) or the real cache, on real
files and a real redis-server."""

from __future__ import annotations

import errno
import hashlib
import mmap
import time
from dataclasses import dataclass

import pytest
import torch

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.keys import chain_keys
from tests.conftest import SIGNED
from tests.connector_harness import TOKENS, Engine, Request, geometry, loading_all


def h(*path: object) -> bytes:
    return hashlib.blake2b(repr(path).encode(), digest_size=16).digest()


@dataclass
class TokenRequest(Request):
    """A request whose tokens KV events announce."""

    @property
    def all_token_ids(self) -> list[int]:
        return list(range(self.num_tokens))


def test_kv_events_keep_no_payload_of_a_block_whose_store_was_refused():
    """KV events remember the engine's view (hashes, tokens) of a block when its store is planned, and forget it
    when the block leaves the directory. A block whose store was refused (here: stored on its second sighting;
    each turn of a session adds a block seen once) never enters the directory, so it never left it either: its
    payload stayed for good, one per session (200 of 264 kept before)."""
    config = parse_config({"cpu_bytes_to_use": 64 * 4096, "block_size": TOKENS, "engine_block_size": TOKENS,
                           "admit_after_sightings": 2})
    engine = Engine(config, num_blocks=64)
    engine.scheduler = SchedulerSide(loading_all(config), geometry(1), kv_events=True)
    try:
        for session in range(50):  # turn t's prompt is the session's first t + 1 blocks
            for turn in range(4):
                r = TokenRequest(f"s{session}t{turn}", [h("s", session, i) for i in range(turn + 1)])
                assert engine.admit(r)
                engine.run(r)
        engine.drain()
        events, directory = engine.scheduler.events, engine.scheduler.directory
        assert events is not None
        assert [key for key in events.payloads if key not in directory] == []
        assert len(events.payloads) <= len(directory)
        assert events.take(), "blocks were stored and announced"
    finally:
        engine.close()


def nothing_left_behind(engine: Engine) -> None:
    """Every load was reported by every worker: no plan pending, no block pinned, no byte left queued."""
    for _ in range(20):
        engine.step()
    scheduler = engine.scheduler
    assert not scheduler.has_pending_work()
    assert scheduler.directory.pinned() == []
    assert all(n == 0 for n in scheduler.control.decider.queued.values()), dict(scheduler.control.decider.queued)


def test_a_shared_fetch_that_gets_no_buffer_reports_its_steps(redis_server, monkeypatch):
    """The shared fetch reads a batch into a buffer of its thread's own (an mmap of up to 32 MiB). When that
    mapping fails (ENOMEM), the batch's blocks are lost to the load, as any failed read: reported, so that the
    host blocks the load pinned and the bytes the decision counted as queued come back. Before, the error left
    the per-batch `try`: the worker reported the request, but none of its fetch's steps, for good."""
    config = parse_config({"cpu_bytes_to_use": 8 * 4096, "block_size": 16, "engine_block_size": 16,
                           **SIGNED, "secondary_tiers": [{"type": "redis", "url": redis_server.url,
                                                                       "max_bytes": 1 << 26}]})
    a, b = Engine(config), Engine(config)
    try:
        document = [h("doc", i) for i in range(6)]
        first = Request("a", document)
        a.admit_when_answered(first)
        a.run(first)
        a.drain()
        time.sleep(0.2)  # the write-through to Redis runs after the host stores
        a.drain()
        warm = Request("b0", document[:2])
        b.admit_when_answered(warm)
        b.run(warm)
        b.drain()  # b holds the first 2 blocks in host (fetched from Redis); Redis has all 6

        def no_memory(*args: object, **kwargs: object) -> mmap.mmap:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

        second = Request("b1", document)
        # 2 from host, 4 fetched from Redis straight into the engine's blocks: a larger buffer
        b.admit_when_answered(second)
        with monkeypatch.context() as patch:
            patch.setattr(mmap, "mmap", no_memory)
            b.run(second)
        assert second.promised == 6 * 16
        nothing_left_behind(b)
    finally:
        a.close()
        b.close()


def test_a_load_the_mover_cannot_start_reports_every_step_failed(tmp_path):
    """Whatever raises in a load (here the mover's read pool refuses work, as once it was shut down), every step
    of its plan is reported: failed, so that vLLM recomputes the blocks and the scheduler unpins them. Before,
    only the request was reported, and its plan stayed pending."""
    config = parse_config({"cpu_bytes_to_use": 2 * 4096, "block_size": 16, "engine_block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": 64 * 8192,
                                                "admission": {"min_sightings": 1}}]})
    engine = Engine(config)
    try:
        document = [h("doc", i) for i in range(2)]
        for n, blocks in enumerate([document] + [[h("other", n, i) for i in range(2)] for n in range(3)]):
            turn = Request(f"a{n}", blocks)  # the others push the document out of host, down to disk
            engine.admit_when_answered(turn)
            engine.run(turn)
            engine.drain()
        mover = engine.workers[0].mover
        for pool in (mover._reads, *mover._tier_reads.values()):  # loads from disk run on one of these
            pool.shutdown()
        second = Request("b", document)
        engine.admit_when_answered(second)
        assert second.is_async and second.promised == 2 * 16  # disk hits
        loaded = engine.loaded
        engine.run(second)
        assert engine.loaded == loaded and engine.wrong == 0  # its blocks were reported failed: vLLM recomputes them
        nothing_left_behind(engine)
    finally:
        engine.close()


def block_files(root) -> int:
    return sum(1 for path in root.rglob("*.kv"))


def test_a_graceful_stop_flushes_host_within_the_disk_tier_bound_and_a_restart_serves_it(tmp_path):
    """A graceful stop writes the host tier's blocks to the first disk tier. The directory that bounds that tier is
    gone by then, so the worker bounds the flush by what its disk store tells: its files and the tier's capacity.
    The host blocks (used last) take the place of the oldest files, never of a file a flushed block needs as its
    parent, so that a restart adopts every file and serves the document whole. Before, the flush wrote every host
    block no file held, past the bound (8x max_bytes after one stop in the issue's script)."""
    root = tmp_path / "kv"
    config = parse_config({"cpu_bytes_to_use": 4 * 4096, "block_size": 16, "engine_block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(root), "max_bytes": 6 * 8192,
                                                "admission": {"min_sightings": 1}}]})
    document = [h("doc", i) for i in range(4)]
    engine = Engine(config)
    try:  # the document's first half goes down to disk with older blocks; its second half stays in host
        turns = [document[:2]] + [[h("other", n, i) for i in range(2)] for n in range(3)] + [document]
        for n, blocks in enumerate(turns):
            turn = Request(f"t{n}", blocks)
            engine.admit_when_answered(turn)
            engine.run(turn)
            engine.drain()
        assert block_files(root) == 6, "the disk tier is full of older blocks"
    finally:
        engine.close()  # the graceful stop: the worker's flush
    assert block_files(root) == 6  # within max_bytes; before: 8

    again = Engine(config)
    try:
        assert again.scheduler.directory.tier["disk"].used_blocks == 6  # every file adopted: no orphan among them
        whole = Request("whole", document)
        again.admit_when_answered(whole)
        assert whole.promised == 4 * 16  # the document, from disk: its first half was kept for its second
        again.run(whole)
        assert again.loaded == 4 and again.wrong == 0
    finally:
        again.close()


def test_a_graceful_stop_after_a_cache_reset_writes_none_of_the_old_blocks_to_disk(tmp_path):
    """The flush writes what each host slot holds, as the slab labels it. After vLLM's reset_prefix_cache (a
    weight update in place) the host slots hold KV of the old weights, freed but not overwritten: the workers
    forget their labels at the reset, so a graceful stop writes none of them back to disk for a restart to serve."""
    root = tmp_path / "kv"
    config = parse_config({"cpu_bytes_to_use": 8 * 4096, "block_size": 16, "engine_block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(root), "max_bytes": 64 * 8192}]})
    engine = Engine(config)
    try:
        turn = Request("old", [h("old", i) for i in range(3)])
        engine.admit_when_answered(turn)
        engine.run(turn)
        engine.drain()
        host = engine.workers[0].stores.host
        assert len(host.labelled()) == 3 and block_files(root) == 0  # in host only (write_back)
        engine.scheduler.reset_cache()
        engine.step()
        assert host.labelled() == []
    finally:
        engine.close()  # the graceful stop: the worker's flush
    assert block_files(root) == 0


def test_a_host_tier_larger_than_the_disk_tier_flushes_only_what_the_disk_tier_holds(tmp_path):
    """The issue's case: 32 host blocks, a disk tier of 4. The stop writes 4 (parents before their children), and
    a restart adopts all 4: no orphan to delete, nothing past the bound to trim. Before: 32 files, 8x max_bytes."""
    root = tmp_path / "kv"
    config = parse_config({"cpu_bytes_to_use": 32 * 4096, "block_size": 16, "engine_block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(root), "max_bytes": 4 * 8192}]})
    engine = Engine(config)
    try:
        for n in range(16):
            r = Request(f"r{n}", [h(n, 0), h(n, 0, 1)])
            engine.admit_when_answered(r)
            engine.run(r)
        engine.drain()
        assert block_files(root) == 0
    finally:
        engine.close()
    assert block_files(root) == 4
    again = Engine(config)
    try:
        assert again.scheduler.directory.tier["disk"].used_blocks == 4
    finally:
        again.close()


def test_a_namespace_change_removes_the_old_namespaces_blocks(tmp_path):
    """Each namespace (here: three versions of a model's weights) has a folder of its own under root_dir. A start
    removes the folders of other namespaces, which this engine cannot read and no bound counts (one engine per
    root_dir), so the tier holds at most max_bytes of files whatever was served before. Before, every version
    left its folder for good: 3 versions, 3x max_bytes. Anything else under root_dir is left alone."""
    root = tmp_path / "kv"
    config = parse_config({"cpu_bytes_to_use": 8 * 4096, "block_size": 16, "secondary_tiers": [
        {"type": "fs", "root_dir": str(root), "max_bytes": 16 * 8192, "write_policy": "write_through",
         "admission": {"min_sightings": 1}}]})
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "keep.kv").write_bytes(b"not ours")
    (root / ("ab" * 16)).symlink_to(root / "notes")  # a link named like a namespace: not followed
    for version in ("v1", "v2", "v3"):
        with TieredCache(config, (2, 16, 64), torch.float16, model=f"my-model-{version}") as cache:
            for p in range(40):
                keys = chain_keys(list(range(p * 1000, p * 1000 + 16)), 16)
                cache.store(keys, [torch.full((2, 16, 64), float(p), dtype=torch.float16)])
                cache.flush()
            namespaces = [d for d in root.iterdir() if len(d.name) == 32 and not d.is_symlink()]
            assert [d.name for d in namespaces] == [cache.namespace.digest()]
            assert sum(1 for _ in root.rglob("*.kv")) == 16 + 1  # this version's tier, full; and the user's file
    assert (root / "notes" / "keep.kv").read_bytes() == b"not ours" and (root / ("ab" * 16)).is_symlink()


def test_a_disk_tier_with_a_rank_on_another_machine_is_refused_at_startup(tmp_path):
    """The restart scan runs in the scheduler's process, on its file system. A rank whose worker runs on another
    machine keeps its files out of that scan's sight: before, they were never adopted nor bounded, and rank 0's
    blocks were deleted for lacking that rank's shard, silently. Now each worker's store holds its rank's folder,
    and a start where a rank's folder is held by no process here is refused, naming the field and the ranks."""
    from kvtier.config import ConfigError
    from kvtier.integrations.vllm.worker import WorkerSide
    from kvtier.stores.disk import DiskStore

    root = tmp_path / "kv"
    config = parse_config({"cpu_bytes_to_use": 8 * 4096, "block_size": 16, "engine_block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(root), "max_bytes": 8 * 8192}]})
    geo = geometry(2)
    previous = DiskStore(root, geo.namespace(0), 0, 4096)  # what rank 0 wrote in an earlier run
    previous.write(h("kept"), None, bytes(4096))
    previous.close()
    worker = WorkerSide(config, geo, 0)  # rank 0's worker runs here; rank 1's on another node
    worker.register_kv_caches({"layer0": torch.zeros(8, 4096, dtype=torch.uint8)}, 8)
    try:
        with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.root_dir.*rank\(s\) \[1\]"):
            SchedulerSide(loading_all(config), geo)
    finally:
        worker.shutdown()
    assert sum(1 for _ in root.rglob("*.kv")) == 1  # rank 0's block was not deleted as incomplete


def slow_redis_scheduler(redis_server, proxy, **tier: object) -> SchedulerSide:
    config = parse_config({"cpu_bytes_to_use": 64 * 4096, "block_size": 16, "engine_block_size": 16, **SIGNED,
                           "secondary_tiers": [{"type": "redis", "url": proxy.url, "max_bytes": 1 << 24,
                                                "socket_timeout_s": 5.0, **tier}]})
    return SchedulerSide(loading_all(config), geometry(1))


def ask_until_answered(scheduler: SchedulerSide, request: Request) -> int:
    """As vLLM does: the request waits (None) and is asked again each step until the lookup has an answer."""
    for _ in range(1000):
        promised, _ = scheduler.get_num_new_matched_tokens(request, 0)
        if promised is not None:
            return promised
        time.sleep(0.01)
    raise AssertionError(f"{request.request_id} waited for its lookup for good")


def test_a_slow_redis_lookup_lets_the_request_go_on_without_the_tier_at_its_deadline(redis_server):
    """A Redis that answers each reply in 0.5 s, within its socket timeout (the breaker stays closed): a request
    waits `lookup_deadline_s`, then goes on without the tier, counted. Before, it waited for the answer however
    long it took, and with 2 lookup threads and an unbounded queue, 79 of 120 requests waited a median 2.3 s."""
    from kvtier.keys import precomputed_keys
    from kvtier.stores.redis import RedisStore
    from tests.delay_proxy import DelayProxy

    hashes = [h("doc", i) for i in range(4)]
    other = RedisStore(redis_server.url, geometry(1).namespace(0), 4096, 1 << 24)  # another engine stored them
    keys = precomputed_keys(hashes, group=0)
    other.put_many([(k, keys[i - 1] if i else None, bytes(4096)) for i, k in enumerate(keys)])
    other.close()
    proxy = DelayProxy(redis_server.port, delay_s=0.5)
    try:
        scheduler = slow_redis_scheduler(redis_server, proxy, lookup_deadline_s=0.05)
        assert ask_until_answered(scheduler, Request("r", hashes)) == 0  # before: 64, half a second or more later
        assert scheduler.lookup.skipped == {"deadline": 1}
        assert scheduler.stats.payload()["counters"]["shared_lookups_skipped"] == {"deadline": 1}
    finally:
        proxy.close()


def test_lookups_in_flight_are_bounded_and_a_request_past_the_bound_goes_on_at_once(redis_server):
    """At most `lookup_queue_depth` lookups are queued or asking; a request past it is answered at once without
    the tier (counted), instead of queueing behind the others with no bound."""
    from tests.delay_proxy import DelayProxy

    proxy = DelayProxy(redis_server.port, delay_s=0.5)
    try:
        scheduler = slow_redis_scheduler(redis_server, proxy, lookup_queue_depth=4, lookup_deadline_s=30)
        first = [scheduler.get_num_new_matched_tokens(Request(f"r{n}", [h(n, i) for i in range(4)]), 0)[0]
                 for n in range(20)]
        assert first == [None] * 4 + [0] * 16  # before: 20 waiting
        assert scheduler.lookup.skipped == {"queue_full": 16}
    finally:
        proxy.close()


@pytest.mark.parametrize("field", ["lookup_deadline_s", "lookup_queue_depth"])
def test_the_lookup_bounds_are_validated_naming_the_field(field):
    from kvtier.config import ConfigError

    tier = {"type": "redis", "url": "redis://127.0.0.1:6379/0", "max_bytes": 1 << 20, "trusted_network": True}
    assert parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{**tier, field: 3}]})
    with pytest.raises(ConfigError, match=rf"secondary_tiers\[0\]\.{field}"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{**tier, field: 0}]})
