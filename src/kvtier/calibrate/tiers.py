"""What kvtier's own data path costs on this machine: loads of k blocks from each tier into an engine's KV pages,
and the store path's copy out of them, through the stores and the mover the connector's worker runs.

The rig is the worker's, wired from a config by `kvtier.wiring` (host slab, a DiskStore under a temp folder, a
RedisStore under a key prefix of its own): the engine's pages are `Pages` of uint8 rows, as the worker views
vLLM's KV tensors, and each load is the plan the worker hands the mover: host hits as one batch of GETs,
disk and Redis hits read straight into the pages (vLLM's loads are not staged through host). Blocks are not
signed (no `auth_key_env`; signing adds a keyed hash per block). Every figure is the median of a few
repetitions after an untimed one, and the first load of each size is checked byte for byte.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.calibrate import CalibrationError
from kvtier.config import KVTierConfig, parse_config, redact_url
from kvtier.directory import CALLER, Op, Plan, Status, Step
from kvtier.keys import Namespace
from kvtier.layout import ALIGN, round_up
from kvtier.metrics import Metrics
from kvtier.mover.copy import ready_event
from kvtier.mover.pages import Pages
from kvtier.sizing import HOST, host_slots, local_tiers, shared_tier
from kvtier.stores.base import Stores
from kvtier.stores.host import HostSlab
from kvtier.timing import fresh_keys
from kvtier.wiring import build_mover, disk_stores, redis_store

LOAD_BLOCKS = (1, 4, 16, 64)  # blocks per load: a latency and a bandwidth to fit
MAX_LOAD_BYTES = 256 << 20  # a load bigger than this is left out (k=1 always kept)
REPETITIONS = 7  # timed, after one untimed
SCRATCH_BYTES = 64 << 20  # written before each repetition: the blocks are not in the CPU's caches (a load from a
# host tier of gigabytes seldom finds them there)
PAGES = 8  # pages per engine block (layers x K and V): the tiny model's 4 layers
Point = tuple[float, float]  # (bytes moved, seconds)


def load_sizes(block_bytes: int) -> list[int]:
    """The blocks per load measured for blocks of `block_bytes`."""
    return [k for k in LOAD_BLOCKS if k == 1 or k * block_bytes <= MAX_LOAD_BYTES]


def measure_tiers(block_bytes: int, disk_root: Path | None = None, redis_url: str | None = None,
                  on_point: Callable[[str, Point], None] | None = None) -> dict[str, list[Point]]:
    """{"host", "disk", ["redis"], "store"}: (bytes moved, seconds) of loads of k blocks of `block_bytes` from
    that tier into the engine's pages ("store": the engine's pages into host slots), for each k of `load_sizes`.
    The disk tier lives in a temp folder under `disk_root` (default: the system's temp folder), removed after;
    Redis only with `redis_url`, its keys under a prefix of this call's own, deleted after.
    `on_point(tier, point)` is called after each point."""
    if block_bytes < 1:
        raise ValueError(f"measure_tiers: block_bytes must be >= 1, got {block_bytes}")
    sizes = load_sizes(block_bytes)
    if redis_url is not None:
        _reachable(redis_url)
    if disk_root is not None:
        disk_root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="kvtier-calibrate-", dir=disk_root))
    try:
        _room(folder, sum(sizes) * (block_bytes + 2 * ALIGN))
        rig = _Rig(block_bytes, max(sizes), folder, redis_url)
        try:
            return rig.measure(sizes, on_point)
        finally:
            rig.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _room(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < 2 * need:
        raise CalibrationError(f"{folder}: {free} bytes free, the disk tier's measurement needs {2 * need}")


class _Rig:
    """The worker's stores and mover over engine pages of room for `most` blocks twice (sources, targets)."""

    def __init__(self, block_bytes: int, most: int, folder: Path, redis_url: str | None) -> None:
        self.block_bytes = block_bytes
        self.prefix = f"kvtier-calibrate-{uuid.uuid4().hex[:12]}:"
        self.config = _config(block_bytes, most, folder, redis_url, self.prefix)
        namespace = Namespace(model="kvtier-calibrate", dtype="uint8", block_size=self.config.block_size,
                              kv_layout=f"{PAGES}x{block_bytes // PAGES}").digest()
        self.stores = Stores(HOST, HostSlab(host_slots(self.config, block_bytes), block_bytes))
        try:
            self.stores.local.update(disk_stores(self.config, block_bytes, namespace, 0, f"calibrate-{uuid.uuid4()}"))
            shared = shared_tier(self.config)
            if shared is not None:
                self.stores.shared[shared[0]] = redis_store(shared[1], namespace, block_bytes)
        except BaseException:
            self.stores.close()
            raise
        self.disk = local_tiers(self.config)[0][0]
        self.redis = shared[0] if shared is not None else None
        self.statuses: Counter[Status] = Counter()
        self._lock = threading.Lock()
        self.mover = build_mover(self.config, self.stores, self._report, Metrics(None, self.config.block_size))
        per_page = block_bytes // PAGES if block_bytes % PAGES == 0 else block_bytes
        gen = torch.Generator().manual_seed(0)  # torch's memory, as vLLM's KV (numpy's is slower to write here)
        self.pages = Pages([torch.randint(0, 256, (2 * most, per_page), dtype=torch.uint8, generator=gen)
                            for _ in range(block_bytes // per_page)])
        ids = random.Random(0).sample(range(2 * most), 2 * most)  # an engine's free blocks, in no order
        self.sources, self.targets = [[b] for b in ids[:most]], [[b] for b in ids[most:]]
        self.scratch = mmap.mmap(-1, SCRATCH_BYTES)
        self._scratch_at = ctypes.addressof(ctypes.c_char.from_buffer(self.scratch))

    def _report(self, steps: Sequence[Step], status: Status) -> None:
        with self._lock:
            self.statuses[status] += len(steps)

    def measure(self, sizes: Sequence[int], on_point: Callable[[str, Point], None] | None) -> dict[str, list[Point]]:
        """Every (tier, k) once per round, rounds in turn: a stretch of noise (another process busy for a while)
        hits every size alike rather than one size's every repetition. The first round is untimed and checked."""
        names = {"store": "store", HOST: "host", self.disk: "disk"} | ({self.redis: "redis"} if self.redis else {})
        keys = {k: fresh_keys(k) for k in sizes}
        self._fill(keys, [t for t in names if t not in ("store", HOST)])
        times: defaultdict[tuple[str, int], list[float]] = defaultdict(list)
        for rep in range(REPETITIONS + 1):
            for k in sizes:
                for tier, name in names.items():
                    seconds = self._once(keys[k], tier, rep)
                    if rep:
                        times[(name, k)].append(seconds)
                    elif tier != "store":
                        self._check(k, name)
            self._expect(None)
        out: dict[str, list[Point]] = {}
        for name in names.values():
            out[name] = [(float(k * self.block_bytes), statistics.median(times[(name, k)])) for k in sizes]
            for point in out[name]:
                if on_point is not None:
                    on_point(name, point)
        return out

    def _fill(self, keys: dict[int, list[bytes]], lower: list[str]) -> None:
        """Every host slot holds its source block, and each `lower` tier every size's blocks, written down from
        host as a demotion or a write-through writes them."""
        self._store(keys[max(keys)], Op.PUT, CALLER, HOST)
        for tier in lower:
            for k in keys:
                self._store(keys[k], Op.COPY, HOST, tier)
        self._expect(sum(keys) * len(lower) + max(keys))

    def _once(self, keys: list[bytes], tier: str, rep: int) -> float:
        """Seconds of one store ("store") or load from `tier`, with nothing to write back and nothing cached."""
        os.sync()
        self._evict(rep)
        if tier == "store":
            return self._store(keys, Op.PUT, CALLER, HOST)
        return self._load(keys, tier)

    def _evict(self, value: int) -> None:
        """Write the scratch buffer: no block left in the CPU's caches. In this thread, with libc's memset: torch's
        fill would wake OpenMP threads that spin on, against the copies timed next."""
        ctypes.memset(self._scratch_at, value, SCRATCH_BYTES)

    def _store(self, keys: list[bytes], op: Op, src: str, dst: str) -> float:
        """Store `keys` (engine blocks into host slots, or host slots down to `dst`) and wait for it."""
        chains = [[Step(op, key, src, dst, src_slot=None if op is Op.PUT else i, dst_slot=i if op is Op.PUT else None,
                        index=i, parent=keys[i - 1] if i else None)] for i, key in enumerate(keys)]
        if not self.mover.reserve_store():
            raise CalibrationError("the mover's store queue is full")
        blocks = self.pages.blocks(self.sources[: len(keys)])
        start = time.perf_counter()
        self.mover.store(Plan(chains=chains), blocks, ready=ready_event(self.pages.tensors))
        self.mover.flush()
        return time.perf_counter() - start

    def _load(self, keys: list[bytes], tier: str) -> float:
        """Load `keys` from `tier` into the target engine blocks, as the worker hands a load to the mover."""
        chains = [[Step(Op.GET, key, tier, CALLER, src_slot=i if tier == HOST else None, index=i)]
                  for i, key in enumerate(keys)]
        plan = Plan(chains=chains, keys=list(keys), sources=[tier] * len(keys))
        out = self.pages.blocks(self.targets[: len(keys)])
        start = time.perf_counter()
        loaded = self.mover.load(plan, out, ready=ready_event(self.pages.tensors))
        seconds = time.perf_counter() - start
        if not all(loaded.delivered):
            raise CalibrationError(f"load from {tier}: {loaded.delivered.count(False)} of {len(keys)} blocks did not"
                                   f" arrive ({dict(self.statuses)})")
        return seconds

    def _expect(self, ok: int | None) -> None:
        """Every step reported so far ended OK (`ok` of them, where known); the count starts again."""
        with self._lock:
            statuses, self.statuses = dict(self.statuses), Counter()
        failed = {s.value: n for s, n in statuses.items() if s is not Status.OK}
        if failed or (ok is not None and statuses.get(Status.OK, 0) != ok):
            raise CalibrationError(f"the tiers' steps did not all complete: {failed or statuses}")

    def _check(self, k: int, tier: str) -> None:
        """The blocks a load put into the engine's pages are those stored from them (then zeroed, so that the next
        check sees its own load). With numpy: torch's kernels leave OpenMP threads spinning, against what is timed
        next."""
        sources = [b for run in self.sources[:k] for b in run]
        targets = [b for run in self.targets[:k] for b in run]
        for page in self.pages.tensors:
            rows = page.numpy()
            if not np.array_equal(rows[sources], rows[targets]):
                raise CalibrationError(f"load from {tier}: a block arrived different from the one stored")
            rows[targets] = 0

    def close(self) -> None:
        try:
            self.mover.close()
        finally:
            if self.redis is not None:
                _forget(self.config, self.prefix)
            self.stores.close()


def _config(block_bytes: int, most: int, folder: Path, redis_url: str | None, prefix: str) -> KVTierConfig:
    """Host room for `most` blocks, a disk tier in `folder`, Redis (trusted: blocks unsigned) under `prefix`."""
    room = 4 * len(LOAD_BLOCKS) * most * (block_bytes + 2 * ALIGN)
    tiers: list[dict] = [{"type": "fs", "root_dir": str(folder / "tier"), "max_bytes": room}]
    if redis_url is not None:
        tiers.append({"type": "redis", "url": redis_url, "max_bytes": room, "key_prefix": prefix,
                      "trusted_network": True, "socket_timeout_s": 30.0, "connect_timeout_s": 5.0})
    return parse_config({"cpu_bytes_to_use": most * round_up(block_bytes), "block_size": 16,
                         "secondary_tiers": tiers})


def _reachable(url: str) -> None:
    """A Redis that does not answer is named before anything is measured (the tier would only count misses)."""
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5) as client:
            client.ping()
    except (redis.exceptions.RedisError, ValueError) as exc:
        raise CalibrationError(f"{redact_url(url)}: Redis does not answer ({exc})") from None


def _forget(config: KVTierConfig, prefix: str) -> None:
    """Delete every key this measurement made in Redis."""
    import redis

    shared = shared_tier(config)
    assert shared is not None
    client = redis.Redis.from_url(shared[1].url, socket_timeout=30)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 1000):
            client.delete(*keys[i : i + 1000])
    except redis.exceptions.RedisError:
        pass  # Redis went away: nothing more to clean up here
    finally:
        client.close()
