"""kvtier's blocks in vLLM's KV events (`take_events`), so that KV-aware routers see what the tiers hold.

A block that lands in a tier is announced as vLLM's `BlockStored`, with the tier's medium (host: CPU; disk and
the shared store: STORAGE, with the tier's name as `ownership`) and the engine's own view of it: its engine
block hashes, the hash before them and its token ids, as vLLM announces the blocks of its own cache, so a router
matches them. A block that leaves a tier is a `BlockRemoved` with the same hashes and medium. Blocks recovered
from disk at startup are not announced: their tokens are unknown until a request brings them in again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.stores.base import TierKind


@dataclass(frozen=True, slots=True)
class Payload:
    hashes: tuple[Any, ...]  # the engine's block hashes of this kvtier block, in vLLM's external form
    parent: Any | None  # the engine block hash before them
    tokens: tuple[int, ...]


class KVEvents:
    """Payloads of the blocks in the directory (taken when their store is planned) and the events not yet taken.

    A payload goes when its block leaves the directory (`changed` with no tier), so only blocks the directory has
    are remembered: a block whose store was refused (admission, no room) never leaves it, and would stay for good.
    """

    def __init__(self, engine_block_size: int, kind: Callable[[str], TierKind], known: Callable[[bytes], bool]) -> None:
        """`kind`: a tier's medium; `known`: whether the directory has a block (`Directory.__contains__`)."""
        self.engine_block_size = engine_block_size
        self.kind = kind
        self.known = known
        self.payloads: dict[bytes, Payload] = {}
        self.tiers: dict[bytes, set[str]] = {}
        self.pending: list[Any] = []

    def remember(self, request: Any, keys: list[bytes], block_tokens: int) -> None:
        """The engine's view of the request's first `len(keys)` kvtier blocks, whose store was just planned: of
        those the directory has (the others' stores were refused)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        per = block_tokens // self.engine_block_size
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[: len(keys) * per]]
        tokens = request.all_token_ids
        for i, key in enumerate(keys):
            if key in self.payloads or not self.known(key):
                continue
            self.payloads[key] = Payload(tuple(hashes[i * per : (i + 1) * per]), hashes[i * per - 1] if i else None,
                                         tuple(tokens[i * block_tokens : (i + 1) * block_tokens]))

    def changed(self, key: bytes, tier: str | None, stored: bool) -> None:
        """The directory's hook: `key` became readable in `tier` (stored) or left it; `tier` None: the block left
        the directory (its copies left their tiers before)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        if tier is None:  # unreadable from now on, even where a transfer still holds a copy
            for name in sorted(self.tiers.get(key, ())):
                self.changed(key, name, stored=False)
            self.payloads.pop(key, None)
            self.tiers.pop(key, None)
            return
        payload = self.payloads.get(key)
        if payload is None:
            return
        held = self.tiers.setdefault(key, set())
        medium, ownership = self._medium(tier)
        if stored and tier not in held:
            held.add(tier)
            self.pending.append(BlockStored(block_hashes=list(payload.hashes), parent_block_hash=payload.parent,
                                            token_ids=list(payload.tokens), block_size=self.engine_block_size,
                                            lora_id=None, medium=medium, lora_name=None, ownership=ownership))
        elif not stored and tier in held:
            held.discard(tier)
            self.pending.append(BlockRemoved(block_hashes=list(payload.hashes), medium=medium, ownership=ownership))

    def take(self) -> list[Any]:
        events, self.pending = self.pending, []
        return events

    def _medium(self, tier: str) -> tuple[str, str | None]:
        from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

        if self.kind(tier) is TierKind.HOST:
            return MEDIUM_CPU, None
        return MEDIUM_STORAGE, tier
