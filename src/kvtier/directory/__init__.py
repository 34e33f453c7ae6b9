"""The directory: which block lives in which tier, in which state, and what to move (the metadata plane).

`plan` holds what travels to the mover (steps, plans, statuses); `state` what the directory knows (blocks,
copies, tiers); `table` the rules that keep it consistent (room, eviction, demotion, the drop cascade);
`shared` the shared tier's part of the plans; `directory` the planner the drivers call.
"""

from kvtier.directory.directory import Directory, TierUsage
from kvtier.directory.plan import CALLER, Op, Plan, Status, Step
from kvtier.directory.state import NoRoom, SharedSpec, State, Tier, TierSpec

__all__ = ["CALLER", "Directory", "NoRoom", "Op", "Plan", "SharedSpec", "State", "Status", "Step", "Tier",
           "TierSpec", "TierUsage"]
