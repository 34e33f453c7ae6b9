"""Eviction policies behind one small interface, one short class each (as in cachetools).

A policy only *orders* the blocks resident in one tier; the directory owns residency, pins and states.
"""

from __future__ import annotations

from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.priority import PriorityPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "priority": PriorityPolicy,
}


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction_policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(capacity_blocks)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "POLICIES", "PriorityPolicy", "S3FIFOPolicy", "make_policy"]
