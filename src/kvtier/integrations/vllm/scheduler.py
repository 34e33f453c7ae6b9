"""The connector's scheduler half: the directory. It decides; it never touches bytes.

Keys are vLLM's own `request.block_hashes` (the last engine hash of each kvtier block, group 0), never re-hashed. A
hit is promised to vLLM only for blocks readable now, pinned until the workers report them. Host hits load
synchronously, before the forward of the step that computes the rest of the prompt (a memory copy is cheaper than
vLLM's asynchronous round trip); hits in slower tiers load asynchronously. A disk or shared tier's blocks are read
straight into the engine's, and given a host copy by the request's store. A shared-tier block that a transfer of
ours took on between the lookup and the load cannot be loaded: vLLM recomputes it (counted as the load's
shortfall). Stores happen when a request finishes: its blocks are held (`request_finished` returns True) until
the workers have copied them out, so a store never reads a block vLLM has reused.

A shared tier (Redis) is asked for the blocks after the local prefix on a thread of our own: until it
answers, `get_num_new_matched_tokens` returns None and vLLM keeps the request waiting, so the scheduler never
blocks on the network. Other engines may evict what it said it holds: such a fetch fails, and vLLM recomputes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from kvtier.config import KVTierConfig
from kvtier.directory import Directory, Op, Plan, Status, Step
from kvtier.integrations.vllm.control import Control
from kvtier.integrations.vllm.events import KVEvents
from kvtier.integrations.vllm.messages import (
    EngineBlocks,
    KVTierMetadata,
    KVTierWorkerMetadata,
    LoadJob,
    StoreJob,
    worst,
)
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.stats import Deltas, add_breaker
from kvtier.keys import precomputed_keys
from kvtier.sizing import shared_spec, shared_tier, tier_specs
from kvtier.stores.base import SharedStore, TierKind
from kvtier.wiring import disk_stores, recover, redis_store

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
ORPHAN_AUDIT_S = 1.0  # the orphan count walks every block: at most once a second, not on every engine step


@dataclass
class _Pending:
    """A shipped plan: its steps by id, and what to do when the last one completes."""

    plan: Plan
    steps: dict[int, Step]
    kind: str  # "load" | "store" | "delete"
    request_id: str  # the request a load or store is for
    queued: Counter = field(default_factory=Counter)  # a load: its bytes per tier, queued until it completes
    reports: Counter = field(default_factory=Counter)  # step id -> ranks that reported it
    statuses: dict[int, Status] = field(default_factory=dict)  # step id -> the worst status a rank reported


class _Lookup(NamedTuple):
    """What `get_num_new_matched_tokens` promised a request, for `update_state_after_alloc` to plan."""

    first: int  # the first kvtier block to load
    blocks: int  # kvtier blocks promised
    end: int  # the token the promise ends at
    local: int  # tokens vLLM already held (its own prefix hit)
    fetch: bool  # some blocks come from the shared tier
    sync: bool  # all from host: loaded before this step's forward
    found: tuple[str, ...]  # the tier each promised block was found in


class SchedulerSide:
    def __init__(self, config: KVTierConfig, geometry: Geometry, kv_events: bool = False) -> None:
        self.config = config
        self.geo = geometry
        self.directory = Directory(tier_specs(config, geometry.block_nbytes, geometry.world_size),
                                   shared=shared_spec(config, geometry.block_nbytes), stage_loads=False)
        self.events = KVEvents(geometry.engine_block_size, self.directory.kind) if kv_events else None
        if self.events is not None:  # before recovery: what the disk had is not announced (its tokens are unknown)
            self.directory.on_change = self.events.changed
        self.shared_store = self._shared_store()  # the scheduler's own client, for lookups
        self._asking = ThreadPoolExecutor(2, thread_name_prefix="kvtier-lookup") if self.shared_store else None
        self._asked: dict[str, tuple[int, Future]] = {}  # request id -> (first key asked, blocks the store holds)
        self._pending: dict[int, _Pending] = {}  # plan id (its first step id) -> pending plan
        self._plan_of_step: dict[int, int] = {}
        self._lookups: dict[str, _Lookup] = {}  # request id -> what was promised to it
        self._loading: dict[str, bool] = {}  # request id -> its load is synchronous; until vLLM has its result
        self._settling: set[str] = set()  # synchronous loads with no step: vLLM has their result after this step
        self._loads: list[LoadJob] = []
        self._stores: list[StoreJob] = []
        self._deletes: list[Step] = []
        self._stores_in_flight = 0
        self._dropped: Counter = Counter()  # reason -> blocks this half refused to store
        self._shortfall: Counter = Counter()  # tier -> tokens promised to vLLM that no load could take
        self._deltas = Deltas()
        self._generation = b""  # appended to every key once vLLM reset its prefix cache (see reset_cache)
        self._orphans: dict[str, int] = {}
        self._audited_at = float("-inf")
        self.control = Control(config, self.directory, geometry.block_nbytes)
        self._asked_local: dict[str, int] = {}  # request id -> vLLM's own prefix hit (tokens), as last told us
        self._served: dict[str, Counter] = {}  # request id -> tokens its load takes from each kind of tier
        self._returning: set[str] = set()  # requests back from an asynchronous load: counted when it started
        self._recover()
        log.info("kvtier: %s", self.describe())

    # ---------------------------------------------------------------- vLLM's scheduler hooks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        keys = self._keys(request)
        bt = self.geo.block_tokens
        first = num_computed_tokens // bt
        self._asked_local[request.request_id] = num_computed_tokens
        skip = self.control.route(request, engine_hit=num_computed_tokens > 0)
        sources = self.directory.lookup(keys[first:], skip)
        local = first + len(sources)
        shared = self._shared_blocks(request.request_id, keys, local, skip)
        if shared is None:
            return None, False  # the shared tier has not answered yet: vLLM asks again next step
        last = self._last_loadable(request)
        found = sources + [self.directory.shared.name] * shared if shared else sources
        tokens = [min((first + i + 1) * bt, last) - max((first + i) * bt, num_computed_tokens)
                  for i in range(len(found))]
        while tokens and tokens[-1] <= 0:
            tokens.pop()
        take = self.control.blocks_to_load(request.request_id, found[: len(tokens)], tokens)
        end = min((first + take) * bt, last)
        promised = end - num_computed_tokens
        if promised <= 0:
            self._lookups.pop(request.request_id, None)
            return 0, False
        blocks = -(-(end - first * bt) // bt)
        fetch = blocks > len(sources)
        sync = not fetch and all(self.directory.kind(s) is TierKind.HOST for s in sources[:blocks])  # module doc
        self._lookups[request.request_id] = _Lookup(first, blocks, end, num_computed_tokens, fetch, sync,
                                                    tuple(found[:blocks]))
        return promised, not sync

    def _shared_blocks(self, request_id: str, keys: list[bytes], local: int, skip: frozenset[str]) -> int | None:
        """How many blocks after `keys[:local]` the shared tier holds; None while it is being asked."""
        if self._asking is None or local >= len(keys) or self.directory.shared.name in skip:
            return 0
        asked = self._asked.get(request_id)
        if asked is None or asked[0] != local:
            self._asked[request_id] = (local, self._asking.submit(self.shared_store.lookup, keys[local:]))
            return None
        if not asked[1].done():
            return None
        del self._asked[request_id]
        try:
            return asked[1].result()
        except Exception as exc:  # the store's breaker counts what failed; a lookup that fails is a miss
            log.debug("kvtier: shared tier lookup failed: %s", exc)
            return 0

    def _last_loadable(self, request: Request) -> int:
        """As vLLM's own prefix cache: the engine block holding the prompt's last token is always computed,
        so a restored prefix goes through exactly the kernels a local cache hit goes through."""
        ebs = self.geo.engine_block_size
        return (request.num_tokens - 1) // ebs * ebs

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        promise = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or promise is None:  # vLLM may take none of it (e.g. it skips prefix reads)
            self._count_lookup(request, self._asked_local.pop(request.request_id, 0) // self.geo.block_tokens, [])
            return
        self._asked_local.pop(request.request_id, None)
        # vLLM has not updated request.num_computed_tokens yet (and after a failed load it is stale): the local
        # hit it told us in get_num_new_matched_tokens is the truth about which engine blocks it already holds.
        first, promised, end, local, fetch, sync, found = promise
        all_keys = self._keys(request)
        keys = all_keys[first : first + promised]
        engine_ids = blocks.get_block_ids()[0]
        skip = local // self.geo.engine_block_size  # engine blocks vLLM already has
        plan = self.directory.plan_load(keys, shared_end=len(keys) if fetch else 0,
                                        parent=all_keys[first - 1] if first else None,
                                        skip=self.control.route(request, engine_hit=local > 0))
        self._count_lookup(request, first, plan.sources)
        self.control.served(request, plan.sources, engine_hit=local > 0)
        served = self._served[request.request_id] = Counter()
        bt = self.geo.block_tokens
        tokens = [max(0, min((first + i + 1) * bt, end) - max((first + i) * bt, local)) for i in range(len(keys))]
        for source, n in zip(plan.sources, tokens):  # tokens each tier really serves to this request
            served[self.directory.kind(source)] += n
        # what the load could not take (a transfer of ours on the block since the lookup): vLLM recomputes it
        for source, n in zip(found[len(plan.keys) :], tokens[len(plan.keys) :]):
            self._shortfall[source] += n
        targets = [self._engine_blocks(engine_ids, first + i, skip, end) for i in range(len(keys))]
        unavailable = [b for t in targets[len(plan.keys) :] for b in t if b is not None]
        self._loading[request.request_id] = sync
        if sync and not plan.steps:  # nothing to run: vLLM learns of the shortfall from this step's output
            self._settling.add(request.request_id)
        self._ship(plan, "load", request.request_id)
        self._loads.append(LoadJob(request.request_id, plan.chains, targets[: len(plan.keys)], unavailable, sync))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Store the request's computed full blocks; hold its engine blocks until the workers copied them."""
        self.control.finished(request)
        self._returning.discard(request.request_id)
        self._asked.pop(request.request_id, None)
        self._asked_local.pop(request.request_id, None)
        self._served.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        if request.request_id in self._loading:
            # Finished (aborted) before vLLM learnt how its load ended: num_computed_tokens still counts the
            # promise, blocks that never arrive included. vLLM frees its blocks once the load is reported.
            return False, None
        computed = min(request.num_computed_tokens, len(request.block_hashes) * self.geo.engine_block_size)
        keys = self._keys(request)[: computed // self.geo.block_tokens]
        if not keys:
            return False, None
        if self._stores_in_flight >= self.config.queue_depth:
            self._dropped["queue_full"] += len(keys)
            return False, None
        plan = self.directory.plan_store(keys)
        puts = [s for c in plan.chains for s in c if s.op is Op.PUT]
        if not plan.chains:
            return False, None
        if self.events is not None:
            self.events.remember(request, keys, self.geo.block_tokens)
        self._ship(plan, "store")
        sources = [self._engine_blocks(block_ids, i, 0, len(keys) * self.geo.block_tokens) for i in range(len(keys))]
        self._stores.append(StoreJob(request.request_id, plan.chains, sources, holds=bool(puts)))
        return bool(puts), None

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`, e.g. after a weight update: nothing stored before
        may be served again. Every local block is dropped (host slots freed, files deleted, what is in flight
        once its transfer ends), and keys get a new generation from now on, so that no tier, the shared one
        included, can hit an old block: other engines may still use those, which age out by the tier's LRU."""
        self._generation = (int.from_bytes(self._generation or b"\0", "big") + 1).to_bytes(4, "big")
        self.directory.drop_all()
        self._asked.clear()
        self._lookups.clear()
        self._collect_garbage()
        log.info("kvtier: cache reset (generation %d): every tier's blocks are dropped or unreachable",
                 int.from_bytes(self._generation, "big"))
        return True

    def stats_payload(self) -> dict:
        """What changed in the directory since the last call, and the tiers' usage now."""
        d = self.directory
        tokens = {k: v * self.geo.block_tokens for k, v in d.stats.lookup_blocks.items()}
        usage = d.usage()
        payload = {
            "counters": {
                "lookup_tokens": self._deltas.take("lookup_tokens", tokens),
                "evictions": self._deltas.take("evictions", d.stats.evictions),
                "admission_rejects": self._deltas.take("admission_rejects", d.stats.admission_rejects),
                "stores_dropped": self._deltas.take("stores_dropped", d.stats.stores_dropped + self._dropped),
                "failed_deletes": self._deltas.take("failed_deletes", d.stats.failed_deletes),
                "load_shortfall_tokens": self._deltas.take("load_shortfall_tokens", self._shortfall),
            },
            "gauges": {
                "tier_used_bytes": {name: u.used_bytes for name, u in usage.items()},
                "tier_capacity_bytes": {name: u.capacity_bytes for name, u in usage.items()},
                "admission_sightings_needed": {name: u.sightings_needed for name, u in usage.items()},
                "orphan_blocks": self._audit_orphans(),
            },
        }
        counters, gauges = self.control.payload(self._deltas)
        payload["counters"].update(counters)
        payload["gauges"].update(gauges)
        if self.shared_store is not None:
            add_breaker(payload, self.shared_store, d.shared.name, "scheduler", self._deltas)
        return payload

    def _audit_orphans(self) -> dict[str, int]:
        now = time.monotonic()
        if now - self._audited_at >= ORPHAN_AUDIT_S:
            self._orphans, self._audited_at = self.directory.orphans_by_tier(), now
        return self._orphans

    def has_pending_work(self) -> bool:
        """Stores or deletes not yet shipped or not yet completed: the engine must keep stepping to drain them."""
        return bool(self._stores or self._deletes or any(p.kind != "load" for p in self._pending.values()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        self.control.step(scheduler_output)
        idle = scheduler_output.total_num_scheduled_tokens == 0
        meta = KVTierMetadata(self._loads, self._stores, self._deletes, idle)
        self._loads, self._stores, self._deletes = [], [], []
        return meta

    def update_connector_output(self, worker_meta: KVTierWorkerMetadata | None,
                                finished_recving: set[str] | None = None) -> None:
        for request_id in (finished_recving or set()) | self._settling:  # the load's errors came with it
            if self._loading.pop(request_id, None) is False:
                self._returning.add(request_id)
        self._settling.clear()
        if worker_meta is None:
            return
        self.control.transferred(worker_meta.transfers)
        for step_id, (status, reports) in worker_meta.completions.items():
            plan_id = self._plan_of_step.get(step_id)
            if plan_id is None:
                continue
            pending = self._pending[plan_id]
            pending.reports[step_id] += reports
            pending.statuses[step_id] = worst(pending.statuses.get(step_id, Status.OK), status)
            if pending.reports[step_id] < self.geo.world_size:
                continue  # a block is only whole once every rank has its shard: the worst status counts
            self.directory.complete(pending.steps.pop(step_id), pending.statuses.pop(step_id))
            del self._plan_of_step[step_id]
            if not pending.steps:
                del self._pending[plan_id]
                if pending.kind == "load":
                    self.directory.finish_load(pending.plan)
                    self.control.shipped(pending.queued, -1)
                    if self._loading.get(pending.request_id):  # synchronous: its errors came in this step
                        del self._loading[pending.request_id]
                elif pending.kind == "store":
                    self._stores_in_flight -= 1
        self._collect_garbage()

    def served_by_kind(self, request_id: str) -> Counter:
        """The tokens this request's load takes from each kind of tier (TierKind -> tokens), once."""
        return self._served.pop(request_id, Counter())

    def describe(self) -> str:
        """One line for the engine's log: what kvtier configured and took back."""
        d, c = self.directory, self.config
        tiers = ", ".join(f"{t.name} {t.capacity_bytes / 2**20:,.0f} MiB ({t.capacity_blocks:,} blocks, "
                          f"{t.spec.policy}, {t.used_blocks:,} recovered)" for t in d.tiers)
        if d.shared is not None:
            tiers += f", {d.shared.name} (shared)"
        guard = "off" if c.guard is None else c.guard.model_dump_json(exclude_defaults=True)
        return (f"tiers {tiers}; block {self.geo.block_tokens} tokens, {self.geo.block_nbytes:,} B per rank; "
                f"load_policy {c.load_policy}; guard {guard}; namespace {self.geo.namespace(0)[:16]}")

    # ---------------------------------------------------------------- internals

    def _count_lookup(self, request: Request, first: int, sources: list[str]) -> None:
        """A request's prompt by source, in full blocks: vLLM's own hit, each tier's, the rest recomputed."""
        if request.num_preemptions > 0 or request.request_id in self._returning:  # counted before, as vLLM does
            self._returning.discard(request.request_id)
            return
        total = len(request.block_hashes) // (self.geo.block_tokens // self.geo.engine_block_size)
        self.directory.stats.lookup_blocks["engine"] += min(first, total)
        self.directory.record_lookup(sources, max(total - first, len(sources)))

    def _keys(self, request: Request) -> list[bytes]:
        per = self.geo.block_tokens // self.geo.engine_block_size
        hashes = request.block_hashes[per - 1 :: per]
        return [key + self._generation for key in precomputed_keys(hashes, group=0)]

    def _engine_blocks(self, engine_ids: list[int], kvtier_block: int, skip: int, end_token: int) -> EngineBlocks:
        """The engine blocks of one kvtier block; None for those before `skip` or from `end_token` on."""
        per = self.geo.engine_blocks_per_block
        start = kvtier_block * per
        stop = end_token // self.geo.engine_block_size
        return [engine_ids[j] if skip <= j < stop else None for j in range(start, start + per)]

    def _ship(self, plan: Plan, kind: str, request_id: str = "") -> None:
        """Wait for the workers to report each of the plan's steps (by the id the directory gave it)."""
        steps = {step.id: step for chain in plan.chains for step in chain}
        if not steps:
            if kind == "load":
                self.directory.finish_load(plan)
            return
        plan_id = min(steps)
        pending = self._pending[plan_id] = _Pending(plan, steps, kind, request_id)
        if kind == "load":
            pending.queued = Counter({tier: n * self.geo.block_nbytes for tier, n in Counter(plan.sources).items()})
            self.control.shipped(pending.queued, +1)
        for step_id in steps:
            self._plan_of_step[step_id] = plan_id
        if kind == "store":
            self._stores_in_flight += 1

    def _collect_garbage(self) -> None:
        garbage = self.directory.take_garbage()
        if garbage:
            self._ship(Plan(chains=[garbage]), "delete")
            self._deletes.extend(garbage)

    def _shared_store(self) -> SharedStore | None:
        """The scheduler's own client of the shared tier, for lookups (rank 0's namespace stands for all)."""
        found = shared_tier(self.config)
        if found is None:
            return None
        return redis_store(found[1], self.geo.namespace(rank=0), self.geo.block_nbytes, self.config.auth_key())

    def _recover(self) -> None:
        """A restart takes back what the disk tiers of every rank hold (headers only: metadata, no payloads)."""
        owner = self.geo.owner
        ranks = [disk_stores(self.config, self.geo.block_nbytes, self.geo.namespace(rank), rank, owner)
                 for rank in range(self.geo.world_size)]
        try:
            recover(self.directory, ranks)
        finally:
            for disks in ranks:
                for store in disks.values():
                    store.close()
