"""The connector's scheduler half: the directory. It decides; it never touches bytes.

Keys are vLLM's own `request.block_hashes` (the last engine hash of each kvtier block, group 0), never re-hashed. A
hit is promised to vLLM only for blocks readable now, pinned until the workers report them (`lookup`). Host hits
load synchronously, before the forward of the step that computes the rest of the prompt (a memory copy is cheaper
than vLLM's asynchronous round trip); hits in slower tiers load asynchronously. A disk or shared tier's blocks are
read straight into the engine's, and given a host copy by the request's store. A shared-tier block that a transfer
of ours took on between the lookup and the load cannot be loaded: vLLM recomputes it (counted as the load's
shortfall). Stores happen when a request finishes: its blocks are held (`request_finished` returns True) until
the workers have copied them out, so a store never reads a block vLLM has reused. Other engines may evict what
the shared tier said it holds: such a fetch fails, and vLLM recomputes.

The hooks are here; the lookup is `lookup.Lookup`'s, the plans in flight and the rank quorum `inflight.InFlight`'s,
the guard and the decision `control.SchedulerControl`'s, the figures `scheduler_stats.SchedulerStats`'.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig
from kvtier.directory import Directory, Op, Plan, Step
from kvtier.integrations.vllm.control import SchedulerControl
from kvtier.integrations.vllm.events import KVEvents
from kvtier.integrations.vllm.inflight import InFlight, Kind
from kvtier.integrations.vllm.lookup import Lookup, lookup_client
from kvtier.integrations.vllm.messages import EngineBlocks, KVTierMetadata, KVTierWorkerMetadata, LoadJob, StoreJob
from kvtier.integrations.vllm.recovery import recover_ranks
from kvtier.integrations.vllm.requests import RequestState
from kvtier.integrations.vllm.scheduler_stats import SchedulerStats
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.tokens import tokens_served
from kvtier.keys import chain_route, precomputed_keys
from kvtier.sizing import route_blocks, shared_spec, tier_specs

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
GENERATION_BYTES = 16  # a reset's random generation: no two engines' resets ever make the same keys


class SchedulerSide:
    def __init__(self, config: KVTierConfig, geometry: Geometry, kv_events: bool = False) -> None:
        self.config = config
        self.geo = geometry
        self.directory = Directory(tier_specs(config, geometry.block_nbytes, geometry.world_size),
                                   shared=shared_spec(config, geometry.block_nbytes), stage_loads=False)
        self.events = KVEvents(geometry.engine_block_size, self.directory.kind,
                               self.directory.__contains__) if kv_events else None
        if self.events is not None:  # before recovery: what the disk had is not announced (its tokens are unknown)
            self.directory.on_change = self.events.changed
        self.control = SchedulerControl(config, self.directory, geometry.block_nbytes)
        self._route_blocks = route_blocks(config)  # a chain's partition of a clustered shared tier: keys.chain_route
        shared_store = lookup_client(config, geometry)
        self.lookup = Lookup(self.directory, self.control, geometry, shared_store, config)
        self.inflight = InFlight(self.directory, geometry.world_size, geometry.block_nbytes)
        self.stats = SchedulerStats(self.directory, geometry, self.control, shared_store, self.lookup.skipped)
        self._requests: dict[str, RequestState] = {}
        self._settling: set[str] = set()  # synchronous loads with no step: vLLM has their result after this step
        self._loads: list[LoadJob] = []
        self._stores: list[StoreJob] = []
        self._deletes: list[Step] = []
        self._reset = False
        self._generation = b""  # appended to every key once vLLM reset its prefix cache (see reset_cache)
        recover_ranks(config, geometry, self.directory)
        log.info("kvtier: %s", self.stats.describe(config))

    # ---------------------------------------------------------------- vLLM's scheduler hooks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.setdefault(request.request_id, RequestState())
        return self.lookup.match(request, num_computed_tokens, self._keys(request, state), state)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, RequestState())
        promise, state.promise = state.promise, None
        if num_external_tokens <= 0 or promise is None:  # vLLM may take none of it (e.g. it skips prefix reads)
            self._count_lookup(request, state, state.local_tokens, Counter())
            return
        # vLLM has not updated request.num_computed_tokens yet (and after a failed load it is stale): the local
        # hit it told us in get_num_new_matched_tokens is the truth about which engine blocks it already holds.
        first, promised, end, local, fetch, sync, found = promise
        all_keys = self._keys(request, state)
        keys = all_keys[first : first + promised]
        engine_ids = blocks.get_block_ids()[0]
        held = local // self.geo.engine_block_size  # engine blocks vLLM already has
        plan = self.directory.plan_load(keys, shared_end=len(keys) if fetch else 0,
                                        parent=all_keys[first - 1] if first else None,
                                        skip=self.control.route(request, engine_hit=local > 0),
                                        route=chain_route(all_keys, self._route_blocks))
        self.control.served(request, plan.sources, engine_hit=local > 0)
        bt = self.geo.block_tokens
        loaded = len(plan.keys)
        served = tokens_served(plan.sources, first, bt, local, end)  # tokens each tier really serves it
        self._count_lookup(request, state, local, served)
        state.served = Counter()
        for source, n in served.items():
            state.served[self.directory.kind(source)] += n
        # what the load could not take (a transfer of ours on the block since the lookup): vLLM recomputes it
        self.stats.shortfall.update(tokens_served(found[loaded:], first + loaded, bt, local, end))
        targets = self._engine_blocks(engine_ids, first, len(keys), held, end)
        unavailable = [b for t in targets[loaded:] for b in t if b is not None]
        state.loading = sync
        if sync and not plan.steps:  # nothing to run: vLLM learns of the shortfall from this step's output
            self._settling.add(request.request_id)
        self._ship(plan, "load", request.request_id)
        self._loads.append(LoadJob(request.request_id, plan.chains, targets[:loaded], list(plan.sources),
                                   unavailable, sync))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Store the request's computed full blocks; hold its engine blocks until the workers copied them."""
        self.control.finished(request)
        state = self._requests.get(request.request_id)
        if self._forget(request.request_id):
            # Finished (aborted) before vLLM learnt how its load ended: num_computed_tokens still counts the
            # promise, blocks that never arrive included. vLLM frees its blocks once the load is reported.
            return False, None
        computed = min(request.num_computed_tokens, len(request.block_hashes) * self.geo.engine_block_size)
        keys = self._keys(request, state)[: computed // self.geo.block_tokens]
        if not keys:
            return False, None
        if self.inflight.stores >= self.config.queue_depth:
            self.stats.dropped["queue_full"] += len(keys)
            return False, None
        plan = self.directory.plan_store(keys, route=chain_route(keys, self._route_blocks))
        if not plan.chains:
            return False, None
        holds = any(s.op is Op.PUT for c in plan.chains for s in c)
        if self.events is not None:
            self.events.remember(request, keys, self.geo.block_tokens)
        self._ship(plan, "store")
        sources = self._engine_blocks(block_ids, 0, len(keys), 0, len(keys) * self.geo.block_tokens)
        self._stores.append(StoreJob(request.request_id, plan.chains, sources, holds=holds))
        return holds, None

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`, e.g. after a weight update in place (the namespace,
        taken from the weights at startup, stays): nothing stored before may be served again. Every local block is
        dropped (host slots freed, files deleted, what is in flight once its transfer ends), and keys get a new
        generation from now on, so that no tier, the shared one included, can hit an old block: other engines may
        still use those, which age out by the tier's LRU.

        The generation is random (GENERATION_BYTES), never a count: engines sharing a Redis that each reset once
        would count alike and hit each other's blocks, computed by other weights. It is this engine's alone (its
        ranks get it through the keys of its plans) and this run's: a restart reloads the weights from their files,
        which name the namespace again, and starts with none."""
        self._generation = secrets.token_bytes(GENERATION_BYTES)
        self._reset = True  # the workers forget what their host slots held (`KVTierMetadata.reset`)
        self.directory.drop_all()
        for state in self._requests.values():
            state.asked = state.promise = None
        self._collect_garbage()
        log.info("kvtier: cache reset (generation %s): every tier's blocks are dropped or unreachable",
                 self._generation.hex())
        return True

    def stats_payload(self) -> dict:
        return self.stats.payload()

    def has_pending_work(self) -> bool:
        """Stores or deletes not yet shipped or not yet completed: the engine must keep stepping to drain them."""
        return bool(self._stores or self._deletes or self.inflight.busy())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        self.control.step(scheduler_output)
        idle = scheduler_output.total_num_scheduled_tokens == 0
        meta = KVTierMetadata(self._loads, self._stores, self._deletes, idle, self._reset)
        self._loads, self._stores, self._deletes, self._reset = [], [], [], False
        return meta

    def update_connector_output(self, worker_meta: KVTierWorkerMetadata | None,
                                finished_recving: set[str] | None = None) -> None:
        for request_id in (finished_recving or set()) | self._settling:  # the load's errors came with it
            self._load_ended(request_id)
        self._settling.clear()
        if worker_meta is None:
            return
        self.control.transferred(worker_meta.transfers)
        for pending in self.inflight.report(Counter(worker_meta.reported), worker_meta.statuses):
            if pending.kind == "load":
                self.control.landed(pending)
                state = self._requests.get(pending.request_id)
                if state is not None and state.loading is True:  # synchronous: its errors came in this step
                    self._load_ended(pending.request_id)
        self._collect_garbage()

    def served_by_kind(self, request_id: str) -> Counter:
        """The tokens this request's load takes from each kind of tier (TierKind -> tokens), once."""
        state = self._requests.get(request_id)
        if state is None:
            return Counter()
        served, state.served = state.served, Counter()
        return served

    def requests_known(self) -> list[str]:
        """The requests this half keeps state for: from their first lookup to their end (or their load's)."""
        return list(self._requests)

    def promised(self, request_id: str) -> bool:
        """A promise made to `request_id` that `update_state_after_alloc` has not planned yet."""
        state = self._requests.get(request_id)
        return state is not None and state.promise is not None

    # ---------------------------------------------------------------- internals

    def _forget(self, request_id: str) -> bool:
        """The request ended: its state goes, unless a load of it is still unreported (True: it goes then)."""
        state = self._requests.get(request_id)
        if state is not None and state.loading is not None:
            state.finished = True
            state.asked = state.promise = None
            return True
        self._requests.pop(request_id, None)
        return False

    def _load_ended(self, request_id: str) -> None:
        """vLLM has the end of a request's load: an asynchronous one's request comes back to be scheduled (its
        lookup was counted when the load started); a request that finished meanwhile is forgotten now."""
        state = self._requests.get(request_id)
        if state is None or state.loading is None:
            return
        if state.loading is False:
            state.returning = True
        state.loading = None
        if state.finished:
            del self._requests[request_id]

    def _count_lookup(self, request: Request, state: RequestState, local: int, served: Counter) -> None:
        """The tokens of a request's full kvtier blocks by source: vLLM's own hit (`local` tokens), each tier's
        (`served`: a tier -> the tokens it serves, a block's part vLLM holds or recomputes left out), the rest
        recomputed."""
        if request.num_preemptions > 0 or state.returning:  # counted before, as vLLM does
            state.returning = False
            return
        per = self.geo.engine_blocks_per_block
        total = len(request.block_hashes) // per * self.geo.block_tokens
        counts = self.stats.lookup_tokens
        engine = min(local, total)
        counts["engine"] += engine
        counts.update(served)
        counts["miss"] += total - engine - sum(served.values())

    def _keys(self, request: Request, state: RequestState | None = None) -> list[bytes]:
        """The request's keys, one per full kvtier block of its hashes so far; kept in its `state` and extended as
        its hashes grow, so that a long prompt's keys are made once, not at each hook."""
        per, salt = self.geo.block_tokens // self.geo.engine_block_size, self._generation
        known = state.keys if state is not None and state.generation == salt else []
        last = len(known) * per - 1  # the hash the last known key was made of (chained: it stands for all before it)
        if known and (len(request.block_hashes) <= last
                      or precomputed_keys([request.block_hashes[last]], group=0, salt=salt) != known[-1:]):
            known = []
        hashes = request.block_hashes[len(known) * per + per - 1 :: per]
        keys = known + precomputed_keys(hashes, group=0, salt=salt) if hashes else known
        if state is not None:
            state.keys, state.generation = keys, salt
        return keys

    def _engine_blocks(self, engine_ids: list[int], first: int, count: int, held: int,
                       end_token: int) -> list[EngineBlocks]:
        """The engine blocks of kvtier blocks `first` to `first + count - 1`, each a list; None for those before
        `held` or from `end_token` on."""
        per = self.geo.engine_blocks_per_block
        start, stop = first * per, (first + count) * per
        lo = min(max(held, start), stop)
        hi = max(lo, min(end_token // self.geo.engine_block_size, stop))
        middle: list[int | None] = list(engine_ids[lo:hi])
        if len(middle) != hi - lo:
            raise IndexError(f"{len(engine_ids)} engine blocks, {hi} needed")
        ids = [None] * (lo - start) + middle + [None] * (stop - hi)
        return [[i] for i in ids] if per == 1 else [ids[k : k + per] for k in range(0, len(ids), per)]

    def _ship(self, plan: Plan, kind: Kind, request_id: str = "") -> None:
        pending = self.inflight.ship(plan, kind, request_id)
        if pending is not None and kind == "load":
            self.control.shipped(pending, pending.queued)

    def _collect_garbage(self) -> None:
        garbage = self.directory.take_garbage()
        if garbage:
            self._ship(Plan(chains=[garbage]), "delete")
            self._deletes.extend(garbage)

