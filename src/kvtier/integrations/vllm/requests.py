"""What the scheduler half keeps of one request, from its first lookup to its end: one object, forgotten in
one place (`SchedulerSide._forget`)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple


class Promise(NamedTuple):
    """What `get_num_new_matched_tokens` promised a request, for `update_state_after_alloc` to plan."""

    first: int  # the first kvtier block to load
    blocks: int  # kvtier blocks promised
    end: int  # the token the promise ends at
    local: int  # tokens vLLM already held (its own prefix hit)
    fetch: bool  # some blocks come from the shared tier
    sync: bool  # all from host: loaded before this step's forward
    found: tuple[str, ...]  # the tier each promised block was found in


@dataclass
class RequestState:
    local_tokens: int = 0  # vLLM's own prefix hit, as it last told us
    asked: tuple[int, Future, float] | None = None  # the shared tier's answer: (first block asked, blocks it holds,
    # until when the request waits for it)
    promise: Promise | None = None  # until `update_state_after_alloc` plans it
    loading: bool | None = None  # a load vLLM has not learnt the end of: True synchronous, False asynchronous
    served: Counter = field(default_factory=Counter)  # tokens its load takes from each kind of tier, until asked
    returning: bool = False  # back from an asynchronous load: its lookup was counted when the load started
    finished: bool = False  # vLLM finished it before its load was reported: forgotten once it is
    keys: list[bytes] = field(default_factory=list)  # its kvtier keys so far (`SchedulerSide._keys`)
    generation: bytes = b""  # the cache generation they were made in
