"""The directory: which block lives in which tier, in which state, and what to move (the metadata plane).

`directory` is the facade the drivers call. Behind it: `plan` (what travels to the mover: steps, plans,
statuses), `blocks` and `tiers` (what is known), `table` (blocks, chain links, the drop cascade), `room`
(eviction, demotion, copies into a tier), `ledger` (what each step in flight must settle), `loading` and
`storing` (the planners), `shared` (the shared tier's part of the plans), `adopt` (a restart), and the
bounded memories `recency` and `sightings`.
"""

from kvtier.directory.blocks import Block, Copy, CopyState
from kvtier.directory.directory import Directory, TierUsage
from kvtier.directory.plan import CALLER, Op, Plan, Status, Step, pack_chains, unpack_chains
from kvtier.directory.room import NoRoom
from kvtier.directory.stats import DirectoryStats
from kvtier.directory.tiers import SharedSpec, Tier, TierSpec

__all__ = ["CALLER", "Block", "Copy", "CopyState", "Directory", "DirectoryStats", "NoRoom", "Op", "Plan",
           "SharedSpec", "Status", "Step", "Tier", "TierSpec", "TierUsage", "pack_chains", "unpack_chains"]
