"""TieredCache: the in-process facade, directory + mover + stores, for torch tensors on any device.

    cache = TieredCache(config, block_shape=(2, 8, 256, 128), dtype=torch.bfloat16)
    cache.store(keys, blocks)          # returns at once; writes finish in the background
    n = cache.lookup(keys)             # how many leading blocks a load would return
    blocks = cache.load(keys)          # the readable prefix, on the device you ask for

A block is one tensor of `block_shape` and `dtype`; its bytes are stored as they are (never converted), so a
loaded block is bit-identical to the stored one. Tensors passed to `store` must not change until `flush()`
(vLLM's connector holds its blocks the same way until the store completes).

With a `guard` in the config, callers report each request's latency (`load(..., request=id)`, then
`report(id, ttft_s=..., itl_s=...)`); the guard attributes it to the tier whose part of the request's load took
longest and turns a tier off (no reads, no writes, contents kept) while its requests break the budget. Each
tier's part of a load takes at most its `load_timeout_s`: past it, `load` returns the prefix before that part.

With a `redis` tier, caches of the same namespace (model, dtype, block shape, rank, tenant salt) share it,
in one process or on many machines: what one stores (written through from its host tier, in the
background), another finds by `lookup` and gets by `load`, fetched into its own host tier. Redis down or
slow costs at most its timeouts, then nothing (the breaker opens): lookups miss it, stores skip it.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvtier.config import KVTierConfig
from kvtier.control import Control
from kvtier.directory import Directory, Op, Status, Step
from kvtier.keys import Namespace, chain_route
from kvtier.metrics import Metrics
from kvtier.mover.copy import ready_event
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.sizing import route_blocks, shared_spec, shared_tier, tier_specs
from kvtier.stores.blockformat import check_key, valid_key
from kvtier.wiring import build_mover, build_stores, recover

MAX_UNREPORTED = 65_536  # loads whose request has not reported its latency yet


class TieredCache:
    def __init__(
        self,
        config: KVTierConfig,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        namespace: Namespace | None = None,
        rank: int = 0,
        world_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
        model: str | None = None,
        stage_loads: bool = True,
    ) -> None:
        """`model` names what computed the KV (`kvtier.weights.weights_identity` of its checkpoint, or any name
        that changes with the weights); it is part of the namespace, and required with a disk or Redis tier,
        whose blocks outlive this process: blocks of another model with the same shape must never be served.
        `stage_loads=False`: as the vLLM connector loads, a disk or Redis hit is read straight into the result and
        only a later `store` of its key gives it a host copy (for callers that store every block they use)."""
        self.config = config
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.payload_nbytes = math.prod(self.block_shape) * dtype.itemsize
        if namespace is None and model is None and config.secondary_tiers:
            raise ValueError("TieredCache: name the model whose KV this is (model=...): a disk or redis tier keeps "
                             "blocks beyond this process, and another model's blocks of the same shape would be served")
        self.namespace = namespace or Namespace(
            model=model or "in-process", dtype=str(dtype).removeprefix("torch."), block_size=config.block_size,
            kv_layout="x".join(map(str, self.block_shape)), rank=rank, world_size=world_size,
            tenant_salt=config.tenant_salt, auth=config.auth_fingerprint(),
        )
        specs = tier_specs(config, self.payload_nbytes, world_size)
        shared = shared_tier(config)
        self.shared: str | None = shared[0] if shared else None  # the shared tier's name
        self.stores = build_stores(config, self.payload_nbytes, self.namespace.digest(), rank, world_size,
                                   owner=f"cache-{uuid.uuid4().hex}")
        self._lock = threading.RLock()
        self.clock = clock
        self.directory = Directory(specs, clock=clock, shared=shared_spec(config, self.payload_nbytes),
                                   stage_loads=stage_loads)
        self.control = Control(self.directory, config, self.payload_nbytes, start=clock())
        self.guard = self.control.guard
        self._requests: OrderedDict[str, str] = OrderedDict()  # loaded for, not yet reported: id -> source
        self.metrics = Metrics(self.directory, config.block_size, guard=self.guard, lock=self._lock,
                               shared=self.stores.shared)
        self.mover = build_mover(config, self.stores, self._report, self.metrics)
        self._route_blocks = route_blocks(config)
        recover(self.directory, [self.stores.local], self._lock, self._integrity_failures)

    # ---------------------------------------------------------------- the API

    def store(
        self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], parent: bytes | None = None,
        priority: int = DEFAULT_PRIORITY, route: bytes | None = None,
    ) -> int:
        """Store a chain of blocks (`keys[i]` names `blocks[i]`); returns how many new blocks were accepted.

        With `parent` (the chain goes on from a prefix stored before), a clustered shared tier needs the whole
        chain's `route` (`keys.chain_route`) to keep it in its prefix's partition; without it the blocks land
        where `keys` alone route them, and there they are orphans: refused, never wrong.

        Never blocks on I/O: when the store queue is full the whole call is dropped and counted.
        """
        if len(keys) != len(blocks):
            raise ValueError(f"store: {len(keys)} keys but {len(blocks)} blocks")
        _check_keys("store", [*keys, *([parent] if parent is not None else [])])
        for block in blocks:
            self._check(block)
        if not self.mover.reserve_store():
            self.metrics.count("stores_dropped", "queue_full", len(keys))
            return 0
        with self._lock:
            self.control.tick(self.clock())
            plan = self.directory.plan_store(keys, parent=parent, priority=priority,
                                             route=route if route is not None else self._chain_route(keys))
        if not plan.chains:
            self.mover.release_store()
            return 0
        self.mover.store(plan, list(blocks), ready=ready_event(blocks))
        return sum(1 for chain in plan.chains for step in chain if step.op is Op.PUT)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading blocks readable now, from any tier the guard has on (the shared one is asked for the blocks
        after the local prefix: one round trip). No side effects."""
        _check_keys("lookup", keys)
        with self._lock:
            skip = self.control.off()
            local = len(self.directory.lookup(keys, skip))
        return local + self._lookup_shared(keys, local, skip)

    def _chain_route(self, keys: Sequence[bytes]) -> bytes | None:
        """What picks a whole chain's partition in a clustered shared tier (None: one partition)."""
        return chain_route(keys, self._route_blocks)

    def _lookup_shared(self, keys: Sequence[bytes], local: int, skip: frozenset[str]) -> int:
        """How many blocks after `keys[:local]` the shared tier holds (0 without one, or with Redis away)."""
        if self.shared is None or local >= len(keys) or self.shared in skip:
            return 0
        return self.mover.lookup_shared(self.shared, keys[local:], self._chain_route(keys))

    def load(
        self, keys: Sequence[bytes], device: torch.device | str | None = None,
        out: Sequence[torch.Tensor] | None = None, request: str | None = None,
    ) -> list[torch.Tensor]:
        """The longest readable prefix of `keys`, as new tensors on `device` (default CPU).

        With `out` (one contiguous tensor per key, of the cache's block shape and dtype, on any device) the
        blocks are copied into those tensors instead, and the leading ones that were filled are returned:
        no allocation, so no first-touch page faults (`device` is then ignored).

        A block that turns out corrupt or missing on its tier ends the prefix there: it is a miss, and it
        is never returned. Blocks after the local prefix that the shared tier holds are fetched from it,
        staged through the host tier (with `stage_loads=False`, straight into the result). `request`: the id
        the caller will `report` this request's latency under.
        """
        _check_keys("load", keys)
        if out is not None:
            if len(out) != len(keys):
                raise ValueError(f"load: {len(keys)} keys but {len(out)} out tensors")
            for block in out:
                self._check(block)
                if not block.is_contiguous():
                    raise ValueError("load: out tensors must be contiguous")
        with self._lock:
            skip = self._route(request)
            # where the local prefix ends: what the shared tier's lookup starts from (without one, nothing needs it)
            local = len(self.directory.lookup(keys, skip)) if self.shared is not None else 0
        shared_end = local + self._lookup_shared(keys, local, skip)  # network: outside the lock
        with self._lock:
            plan = self.directory.plan_load(keys, shared_end=shared_end, skip=skip, route=self._chain_route(keys))
            self.directory.record_lookup(plan.sources, len(keys))
        if out is None:
            out = [torch.empty(self.block_shape, dtype=self.dtype, device=device or "cpu") for _ in plan.keys]
        try:
            loaded = self.mover.load(plan, out, ready=ready_event(out))
        finally:
            with self._lock:
                self.directory.finish_load(plan)
                garbage = self.directory.take_garbage()
            self.mover.delete(garbage)
        if request is not None and self.guard is not None:  # charged to the tier whose part took longest
            with self._lock:
                self._requests[request] = self.control.source_of(plan.sources, False, loaded.seconds)
        usable = next((i for i, good in enumerate(loaded.delivered) if not good), len(plan.keys))
        return list(out[:usable])

    def report(self, request: str, ttft_s: float | None = None, itl_s: Sequence[float] = ()) -> None:
        """A request's latency, for the guard: its time to first token and/or its gaps between tokens. The
        request is the `request` of an earlier `load`; a request that never loaded counts as a recompute."""
        if self.guard is None:
            return
        with self._lock:
            source = self._requests.pop(request, self.control.source_of((), engine_hit=False))
            self.control.observe(source, self.clock(), ttft_s=ttft_s, itl_s=itl_s)

    def flush(self) -> None:
        """Wait for every store and delete in flight."""
        self.mover.flush()

    def close(self) -> None:
        self.mover.close()
        self.stores.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self) -> dict:
        return self.metrics.snapshot()  # takes our lock to read the directory, and only for that

    # ---------------------------------------------------------------- internals

    def _route(self, request: str | None) -> frozenset[str]:
        """The tiers a load must not read: only a request that will report its latency can be a probe's."""
        if self.guard is None:
            return frozenset()
        if request is None:
            self.control.tick(self.clock())
            return self.control.off()
        skip = self.control.route(self.clock())
        while len(self._requests) >= MAX_UNREPORTED:  # requests never reported: forget the oldest
            self._requests.popitem(last=False)
        return skip

    def _check(self, block: torch.Tensor) -> None:
        if block.shape != self.block_shape or block.dtype != self.dtype:  # a torch.Size is a tuple
            raise ValueError(
                f"block of shape {tuple(block.shape)} {block.dtype}; this cache holds {self.block_shape} {self.dtype}"
            )

    def _report(self, steps: Sequence[Step], status: Status) -> None:
        """Mover threads land here after each step (or batch of steps)."""
        with self._lock:
            self.directory.complete_many(steps, status)
            garbage = self.directory.take_garbage()
        self.mover.delete(garbage)

    def _integrity_failures(self, tier: str, n: int) -> None:
        self.metrics.count("integrity_failures", tier, n)


def _check_keys(call: str, keys: Sequence[bytes]) -> None:
    """Keys every tier can hold: a block's header names its key, and has room for so many bytes only."""
    for i, key in enumerate(keys):
        if not valid_key(key):  # the message is made only for the key that fails
            check_key(key, f"{call}: key {i}")
