"""The block table: every block the directory knows, its copies, its place in the chain, and how it leaves.

Blocks are linked to their parents. A block in no tier any more is *dropped*, and with it every descendant
(no orphans: a block is only useful if its whole prefix is reachable). A dropped block whose copies a
transfer still touches *retires*: lookups no longer find it, its copies stay counted until the last
transfer is done, and then they are freed (a slot back to its tier, a file deleted by a step the caller
runs: `take_garbage`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from kvtier.directory.blocks import Block, CopyState
from kvtier.directory.ledger import StepLedger
from kvtier.directory.plan import Step
from kvtier.directory.sightings import Sightings
from kvtier.directory.tiers import Tier

# (key, tier, stored): a copy became readable in a tier (stored) or left it; tier None: the block left the
# directory. The vLLM connector's KV events.
ChangeHook = Callable[[bytes, str | None, bool], None]


class BlockTable:
    def __init__(self, tiers: list[Tier], ledger: StepLedger, sightings: Sightings) -> None:
        self.tiers = tiers
        self.tier = {t.name: t for t in tiers}
        self.order = [t.name for t in tiers]
        self.ledger = ledger
        self.sightings = sightings
        self.on_change: ChangeHook | None = None
        self.blocks: dict[bytes, Block] = {}
        self.retiring: dict[bytes, Block] = {}  # dropped, with a transfer still in flight
        self._garbage: list[Step] = []  # deletes found outside a plan (cascades during completions)

    # ---------------------------------------------------------------- finding blocks

    def lookup(self, keys: Sequence[bytes], skip: AbstractSet[str] = frozenset()) -> list[str]:
        """The tier each block of the longest readable prefix would come from (fastest first), reading none of
        the tiers in `skip`. Without the first tier, none: it stages every other. No side effects."""
        found: list[str] = []
        if self.order[0] in skip:
            return found
        blocks, ready = self.blocks, CopyState.READY
        order = [name for name in self.order if name not in skip] if skip else self.order
        for key in keys:
            block = blocks.get(key)
            if block is None:
                break
            copies = block.copies
            for name in order:
                copy = copies.get(name)
                if copy is not None and copy.state is ready:
                    found.append(name)
                    break
            else:
                break
        return found

    def find(self, key: bytes) -> Block | None:
        """The block of `key`, live or retiring."""
        return self.blocks.get(key) or self.retiring.get(key)

    def iter_all(self) -> Iterator[Block]:
        """Live blocks, then retiring ones."""
        yield from self.blocks.values()
        yield from self.retiring.values()

    # ---------------------------------------------------------------- joining and leaving

    def link(self, block: Block) -> None:
        """Enter `block` into the table, as a child of its parent if the parent is here."""
        self.blocks[block.key] = block
        if block.parent is not None and (parent := self.blocks.get(block.parent)) is not None:
            parent.add_child(block.key)

    def retire(self, block: Block) -> None:
        """`block` serves a transfer but was never linked (its parent is none of ours): it retires after it."""
        block.retiring = True
        self.retiring[block.key] = block

    def drop(self, block: Block) -> None:
        """`block` is in no tier any more: it and every descendant leave the directory."""
        stack = [block]
        while stack:
            b = stack.pop()
            if self.blocks.pop(b.key, None) is None:
                continue
            self._unlinked(b)
            if b.children is not None:
                stack.extend(self.blocks[k] for k in b.child_keys() if k in self.blocks)
                b.children = None
            b.retiring = True
            for name in b.copies:  # in-flight copies stay counted, but are no longer candidates
                self.tier[name].policy.remove(b.key)
            self.retiring[b.key] = b
            self.release_idle(b)

    def drop_leaf(self, block: Block) -> None:
        """`drop` of a block that holds no copy, pin or child any more: what `drop` comes to for it."""
        if block.children is not None or block.pins:
            self.drop(block)
            return
        del self.blocks[block.key]
        self._unlinked(block)
        block.retiring = True

    def _unlinked(self, block: Block) -> None:
        """`block` just left `blocks`: its sightings kept, its leaving announced, its parent no longer its parent."""
        self.sightings.sight(block.key, block.seen)  # when it comes back, "the second sighting" counts them
        self.announce(block.key, None, False)
        if block.parent is not None and (parent := self.blocks.get(block.parent)) is not None:
            parent.remove_child(block.key)

    def release_idle(self, block: Block) -> None:
        """Free the copies of a dropped block that no transfer touches; it retires once none is left."""
        for name in list(block.copies):
            copy = block.copies[name]
            if copy.state is CopyState.READY and not copy.readers and not block.pins:
                self.remove_copy(block, self.tier[name], already_deleted=False)
        if not block.copies and not block.pins:
            self.retiring.pop(block.key, None)

    def remove_copy(self, block: Block, tier: Tier, already_deleted: bool) -> None:
        """Take `block`'s copy out of `tier`. Its bytes stop counting at once if its slot is free or its file is
        gone already (`already_deleted`), else once the delete planned here has run."""
        copy = block.copies.pop(tier.name)
        tier.policy.remove(block.key)
        self.announce(block.key, tier.name, False)
        if copy.slot is not None:  # a slotted tier's
            tier.free_slots.append(copy.slot)
            tier.used_blocks -= 1
        elif already_deleted:
            if not self.ledger.pay(tier.name):  # else its count goes to a file a failed delete left
                tier.used_blocks -= 1
        else:  # the bytes stay counted until the file (or shared key) is really gone
            self._garbage.append(self.ledger.delete(tier.name, block.key, accounted=True))

    def unpin(self, keys: Sequence[bytes]) -> None:
        blocks, retiring = self.blocks, self.retiring
        for key in keys:
            block = blocks.get(key) or retiring.get(key)  # `find`
            if block is None:
                continue
            block.pins -= 1
            if block.retiring:
                self.release_idle(block)

    def touch_chain(self, blocks: Sequence[Block]) -> None:
        """A hit on a chain: leaf first, so that ancestors stay more recent than descendants."""
        ready = CopyState.READY
        for name in self.order:
            self.tier[name].policy.touch_many([block.key for block in reversed(blocks)
                                               if (copy := block.copies.get(name)) is not None and copy.state is ready])

    def announce(self, key: bytes, tier: str | None, stored: bool) -> None:
        if self.on_change is not None:
            self.on_change(key, tier, stored)

    def take_garbage(self) -> list[Step]:
        """Deletes that became necessary outside a plan; the caller hands them to the mover."""
        garbage, self._garbage = self._garbage, []
        return garbage

    # ---------------------------------------------------------------- invariants, for metrics and tests

    def orphans(self) -> int:
        """Blocks whose parent is in no tier. Always 0 unless there is a bug."""
        return sum(1 for b in self.blocks.values() if b.parent is not None and b.parent not in self.blocks)

    def orphans_by_tier(self) -> dict[str, int]:
        counts = {t.name: 0 for t in self.tiers}
        for b in self.blocks.values():
            if b.parent is not None and b.parent not in self.blocks:
                for name in b.copies:
                    counts[name] += 1
        return counts

    def keys_in(self, tier_name: str, state: CopyState | None = None) -> list[bytes]:
        return [
            b.key for b in self.blocks.values()
            if tier_name in b.copies and (state is None or b.copies[tier_name].state is state)
        ]

    def pinned(self) -> list[bytes]:
        return [b.key for b in self.blocks.values() if b.pins]
