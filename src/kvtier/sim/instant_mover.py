"""The simulator's mover: every planned step completes at once and succeeds.

Replaying a request = what the in-process cache does for it, minus the bytes: look up the chain, load the
hit prefix, store the rest. Per-tier hit counts therefore match a real run of the same sequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.directory import Directory, Plan, Status
from kvtier.policies.base import DEFAULT_PRIORITY


def complete_instantly(directory: Directory, plan: Plan) -> None:
    directory.complete_many((step for chain in plan.chains for step in chain), Status.OK)
    directory.complete_many(directory.take_garbage(), Status.OK)


@dataclass
class ReplayResult:
    requests: int = 0
    blocks: int = 0
    hits: Counter = field(default_factory=Counter)  # source tier -> blocks served from it

    @property
    def hit_ratio(self) -> float:
        return sum(self.hits.values()) / self.blocks if self.blocks else 0.0


def replay_request(
    directory: Directory, keys: Sequence[bytes], priority: int = DEFAULT_PRIORITY
) -> list[str]:
    """One request: load its readable prefix, store the rest. Returns the source tier per hit block."""
    load = directory.plan_load(keys)
    complete_instantly(directory, load)
    directory.finish_load(load)
    directory.record_lookup(load.sources, len(keys))
    hit = len(load.keys)
    if hit < len(keys):
        parent = keys[hit - 1] if hit else None
        complete_instantly(directory, directory.plan_store(keys[hit:], parent=parent, priority=priority))
    return load.sources


def replay(directory: Directory, requests: Iterable[Sequence[bytes]]) -> ReplayResult:
    result = ReplayResult()
    for keys in requests:
        sources = replay_request(directory, keys)
        result.requests += 1
        result.blocks += len(keys)
        result.hits.update(sources)
    return result
