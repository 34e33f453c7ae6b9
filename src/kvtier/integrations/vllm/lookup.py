"""`get_num_new_matched_tokens`: how many tokens kvtier can give a request, and the promise it makes vLLM.

A hit is promised only for blocks readable now, up to the engine block before the prompt's last token (as
vLLM's own prefix cache: that token is always computed, so a restored prefix goes through exactly the kernels
a local cache hit goes through), and only as far as the decision says a load beats recomputing. A shared tier
(Redis) is asked for the blocks after the local prefix on a thread of our own: until it answers, the lookup
returns None and vLLM keeps the request waiting, so the scheduler never blocks on the network. A Redis that is
slow but answers within its socket timeout never opens its breaker, so the wait has bounds of its own: a request
waits `lookup_deadline_s` at most, then goes on without the tier (an answer that comes before vLLM asks again is
still used), and at most `lookup_queue_depth` lookups are in flight (queued or asking): past it, a request goes
on without the tier at once. Both are counted (`kvtier_shared_lookups_skipped_total{reason}`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvtier.config import KVTierConfig
from kvtier.directory import Directory
from kvtier.integrations.vllm.control import SchedulerControl
from kvtier.integrations.vllm.requests import Promise, RequestState
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.tokens import tokens_by_block
from kvtier.keys import chain_route
from kvtier.sizing import route_blocks, shared_tier
from kvtier.stores.base import SharedStore, TierKind
from kvtier.wiring import redis_store

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
PASSED = float("-inf")  # a lookup's deadline once it passed (and was counted)


class Lookup:
    def __init__(self, directory: Directory, control: SchedulerControl, geometry: Geometry,
                 shared_store: SharedStore | None, config: KVTierConfig) -> None:
        self.directory = directory
        self.control = control
        self.geo = geometry
        self.shared_store = shared_store
        self._asking = ThreadPoolExecutor(2, thread_name_prefix="kvtier-lookup") if shared_store else None
        found = shared_tier(config)
        self.deadline_s = found[1].lookup_deadline_s if found else 0.0
        self._slots = threading.BoundedSemaphore(found[1].lookup_queue_depth if found else 1)  # queued or asking
        self.skipped: Counter = Counter()  # reason -> requests that went on without the shared tier's answer
        self._route_blocks = route_blocks(config)

    def match(self, request: Request, num_computed_tokens: int, keys: list[bytes],
              state: RequestState) -> tuple[int | None, bool]:
        """vLLM's answer: (tokens promised, loaded asynchronously); None tokens while the shared tier is asked."""
        bt = self.geo.block_tokens
        first = num_computed_tokens // bt
        state.local_tokens = num_computed_tokens
        skip = self.control.route(request, engine_hit=num_computed_tokens > 0)
        sources = self.directory.lookup(keys[first:], skip)
        local = first + len(sources)
        shared = self._shared_blocks(keys, local, skip, state)
        if shared is None:
            return None, False  # the shared tier has not answered yet: vLLM asks again next step
        last = self._last_loadable(request)
        found = sources + [self._shared_name()] * shared if shared else sources
        tokens = tokens_by_block(first, len(found), bt, num_computed_tokens, last)
        take = self.control.blocks_to_load(request.request_id, found[: len(tokens)], tokens)
        end = min((first + take) * bt, last)
        promised = end - num_computed_tokens
        if promised <= 0:
            state.promise = None
            return 0, False
        blocks = -(-(end - first * bt) // bt)
        fetch = blocks > len(sources)
        sync = not fetch and all(self.directory.kind(s) is TierKind.HOST for s in set(sources[:blocks]))  # module doc
        state.promise = Promise(first, blocks, end, num_computed_tokens, fetch, sync, tuple(found[:blocks]))
        return promised, not sync

    def _shared_blocks(self, keys: list[bytes], local: int, skip: frozenset[str], state: RequestState) -> int | None:
        """How many blocks after `keys[:local]` the shared tier holds; None while it is being asked."""
        if self._asking is None or self.shared_store is None or local >= len(keys) or self._shared_name() in skip:
            return 0
        asked = state.asked
        if asked is None or asked[0] != local:
            return self._ask(keys, local, state)
        _, future, deadline = asked
        if not future.done():
            if time.monotonic() < deadline:
                return None
            if deadline != PASSED:  # counted once; a late answer is still taken if vLLM asks again
                self.skipped["deadline"] += 1
                state.asked = (local, future, PASSED)
            future.cancel()  # a lookup still queued frees its place at once
            return 0
        state.asked = None
        try:
            return future.result()
        except Exception as exc:  # the store's breaker counts what failed; a lookup that fails (or was cancelled)
            log.debug("kvtier: shared tier lookup failed: %s", exc)  # is a miss
            return 0

    def _ask(self, keys: list[bytes], local: int, state: RequestState) -> int | None:
        """Ask the shared tier for the blocks after `keys[:local]` on our threads (None: the answer is awaited),
        or go on without it (0) when `lookup_queue_depth` lookups are already in flight."""
        assert self._asking is not None and self.shared_store is not None
        if not self._slots.acquire(blocking=False):
            self.skipped["queue_full"] += 1
            state.asked = None
            return 0
        try:
            route = chain_route(keys, self._route_blocks)
            future = self._asking.submit(self.shared_store.lookup, keys[local:], route)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        state.asked = (local, future, time.monotonic() + self.deadline_s)
        return None

    def _shared_name(self) -> str:
        assert self.directory.shared is not None
        return self.directory.shared.name

    def _last_loadable(self, request: Request) -> int:
        """The first token of the engine block that holds the prompt's last token: never loaded (module doc)."""
        ebs = self.geo.engine_block_size
        return (request.num_tokens - 1) // ebs * ebs


def lookup_client(config: KVTierConfig, geometry: Geometry) -> SharedStore | None:
    """The scheduler's own client of the shared tier, for lookups (rank 0's namespace stands for all)."""
    found = shared_tier(config)
    if found is None:
        return None
    return redis_store(found[1], geometry.namespace(rank=0), geometry.block_nbytes, config.auth_key())
