"""Plans shipped to the workers, until every rank has reported every step: the rank quorum.

A block is only whole once every rank has its shard, so a step completes in the directory once all ranks
reported it, with the worst status any of them saw. A plan is done when its last step is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvtier.directory import Directory, Plan, Status, Step
from kvtier.integrations.vllm.messages import worst

Kind = Literal["load", "store", "delete"]


@dataclass
class Pending:
    """A shipped plan: its steps by id, and what its completion settles."""

    plan: Plan
    steps: dict[int, Step]
    kind: Kind
    request_id: str  # the request a load or store is for
    queued: Counter = field(default_factory=Counter)  # a load: its bytes per tier, queued until it completes
    # a step whose ranks report it over several messages: the ranks so far, and the worst status they reported
    reports: Counter = field(default_factory=Counter)
    statuses: dict[int, Status] = field(default_factory=dict)


class InFlight:
    def __init__(self, directory: Directory, world_size: int, block_nbytes: int) -> None:
        self.directory = directory
        self.world_size = world_size
        self.block_nbytes = block_nbytes
        self.stores = 0  # store plans shipped and not done
        self._pending: dict[int, Pending] = {}  # plan id (its first step id) -> pending plan
        self._plan_of_step: dict[int, int] = {}
        self._gathering = 0  # steps whose ranks' reports came in several messages, not all of them yet

    def ship(self, plan: Plan, kind: Kind, request_id: str = "") -> Pending | None:
        """Wait for the workers to report each of the plan's steps (by the id the directory gave it). None: the
        plan has no step (a load's pins are released at once)."""
        steps = {step.id: step for chain in plan.chains for step in chain}
        if not steps:
            if kind == "load":
                self.directory.finish_load(plan)
            return None
        plan_id = min(steps)
        pending = self._pending[plan_id] = Pending(plan, steps, kind, request_id)
        if kind == "load":
            pending.queued = Counter({tier: n * self.block_nbytes for tier, n in Counter(plan.sources).items()})
        self._plan_of_step.update(dict.fromkeys(steps, plan_id))
        if kind == "store":
            self.stores += 1
        return pending

    def report(self, reports: Mapping[int, int], statuses: Mapping[int, Status]) -> list[Pending]:
        """Ranks' reports of steps (step id -> ranks that reported it; `statuses`: the worst status a rank saw,
        where it is not OK); the plans now done. A step every rank reported in one message (the common case)
        completes at once; one whose ranks report over several messages is counted until they all have. The
        steps complete in the order reported, in batches of one status (`Directory.complete_many`), each batch
        before the end of a plan."""
        if not statuses and not self._gathering and min(reports.values(), default=0) >= self.world_size:
            return self._all_ok(reports)
        done: list[Pending] = []
        batch: list[Step] = []
        batch_status = ok = Status.OK
        plan_of_step, plans, world_size = self._plan_of_step, self._pending, self.world_size
        for step_id, n in reports.items():
            plan_id = plan_of_step.get(step_id)
            if plan_id is None:
                continue
            pending = plans[plan_id]
            status = statuses.get(step_id, ok)
            if n < world_size or step_id in pending.reports:  # a quorum gathered over several messages
                self._gathering += step_id not in pending.reports
                pending.reports[step_id] += n
                status = pending.statuses[step_id] = worst(pending.statuses.get(step_id, ok), status)
                if pending.reports[step_id] < world_size:
                    continue  # a block is only whole once every rank has its shard: the worst status counts
                self._gathering -= 1
            step = pending.steps.pop(step_id)
            if status is not batch_status:
                self.directory.complete_many(batch, batch_status)
                batch, batch_status = [], status
            batch.append(step)
            del plan_of_step[step_id]
            if not pending.steps:
                self.directory.complete_many(batch, batch_status)
                batch = []
                self._done(plan_id, pending)
                done.append(pending)
        self.directory.complete_many(batch, batch_status)
        return done

    def _all_ok(self, reports: Mapping[int, int]) -> list[Pending]:
        """`report` where every step was reported OK by every rank, and no step's quorum is being gathered: each
        completes at once, in the order reported, a batch ending with each plan."""
        done: list[Pending] = []
        batch: list[Step] = []
        plan_of_step, plans = self._plan_of_step, self._pending
        for step_id in reports:
            plan_id = plan_of_step.pop(step_id, None)
            if plan_id is None:
                continue
            pending = plans[plan_id]
            batch.append(pending.steps.pop(step_id))
            if not pending.steps:
                self.directory.complete_many(batch, Status.OK)
                batch = []
                self._done(plan_id, pending)
                done.append(pending)
        self.directory.complete_many(batch, Status.OK)
        return done

    def _done(self, plan_id: int, pending: Pending) -> None:
        """The last step of a plan completed."""
        del self._pending[plan_id]
        if pending.kind == "load":
            self.directory.finish_load(pending.plan)
        elif pending.kind == "store":
            self.stores -= 1

    def busy(self) -> bool:
        """Stores or deletes not yet completed (loads end with their requests)."""
        return any(p.kind != "load" for p in self._pending.values())
