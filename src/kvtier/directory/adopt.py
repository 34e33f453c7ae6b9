"""A restart: take back the blocks a persistent tier still holds, within its bounds and without orphans."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.directory.blocks import Block, Copy, CopyState
from kvtier.directory.plan import Step
from kvtier.directory.room import Room
from kvtier.policies.base import DEFAULT_PRIORITY


def adopt(room: Room, tier_name: str, blocks: Iterable[tuple[bytes, bytes | None]]) -> list[Step]:
    """See `Directory.adopt`."""
    table, ledger = room.table, room.ledger
    tier = table.tier[tier_name]
    deletes: list[Step] = []
    found = list(blocks)
    known = {key for key, _ in found} | set(table.blocks)
    adopted: list[Block] = []
    for key, parent in found:
        if key in table.blocks and tier_name in table.blocks[key].copies:
            continue
        if parent is not None and parent not in known:
            deletes.append(ledger.delete(tier_name, key))
            continue
        block = table.blocks.get(key) or Block(key, parent, DEFAULT_PRIORITY)
        block.copies[tier_name] = Copy(None, CopyState.READY)
        tier.used_blocks += 1
        tier.policy.insert(key, block.priority)
        if key not in table.blocks:
            table.blocks[key] = block
            adopted.append(block)
    for block in adopted:
        table.link(block)
    for block in adopted:  # a parent that was on disk but not valid leaves orphans behind
        if block.key in table.blocks and block.parent is not None and block.parent not in table.blocks:
            table.drop(block)
    while tier.used_blocks > tier.capacity_blocks:
        victim = room.pick_victim(tier, None)
        if victim is None:
            break
        room.evict(tier, victim, deletes, reason="capacity", demote=False)
    for step in deletes:  # no write follows these: their files count until they are really gone
        if step.src == tier_name and ledger.account(step):
            tier.used_blocks += 1
    return deletes + table.take_garbage()
