"""What travels between the two halves of the connector: plans down, completions up. Small and picklable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.directory import Status, Step, pack_chains, unpack_chains

# Where a block's bytes sit in the engine: per kvtier block, the engine block id of each of its sub-blocks;
# None for a sub-block the engine already holds (a load that starts mid-block skips it).
EngineBlocks = list[int | None]


class _PackedChains:
    """A job whose chains pickle packed (`pack_chains`): vLLM's multiprocess executor pickles each step's
    metadata on the scheduler's thread, and a long prompt's job has a step per block."""

    chains: list[list[Step]]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "chains": pack_chains(self.chains)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, chains=unpack_chains(state["chains"]))


@dataclass
class LoadJob(_PackedChains):
    request_id: str
    chains: list[list[Step]]
    targets: list[EngineBlocks]  # GET step index -> engine blocks to fill
    sources: list[str] = field(default_factory=list)  # GET step index -> the tier its block is read from
    unavailable: list[int] = field(default_factory=list)  # engine blocks promised but not loadable: errors
    sync: bool = False  # host hits: loaded before this step's forward, which computes the rest at once


class LoadTiming(NamedTuple):
    """One tier's part of one request's load, as a worker timed it: what the decision fits a tier's speed to, and
    what the guard charges the request to (the tier whose part took longest)."""

    request_id: str
    tier: str
    blocks: int
    seconds: float  # from the worker's start of the load to the end of this tier's part (or its deadline)
    outcome: str  # "ok": every block arrived; "expired": the part passed its deadline; "failed"


@dataclass
class StoreJob(_PackedChains):
    request_id: str
    chains: list[list[Step]]
    sources: list[EngineBlocks]  # PUT step index -> engine blocks to read
    holds: bool = True  # vLLM holds the request's blocks until we report it in finished_sending


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    deletes: list[Step] = field(default_factory=list)  # garbage: files of dropped blocks
    idle: bool = False  # the engine computes nothing this step: a worker may wait for its stores instead
    reset: bool = False  # the cache was reset: no host slot holds a block a graceful stop may write to disk


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Step completions of one engine step, from every worker. A step is done once all ranks reported it;
    its status is the worst any rank saw (a block is only whole if every shard of it is). Kept as what merges
    cheaply: vLLM merges the ranks' one pair at a time, and a long prompt's plan reports a step per block."""

    reported: list[int] = field(default_factory=list)  # step ids, once for each rank that reported the step
    statuses: dict[int, Status] = field(default_factory=dict)  # step id -> the worst status, where it is not OK
    transfers: list[LoadTiming] = field(default_factory=list)  # each tier's part of each load

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        statuses = dict(self.statuses)
        for step_id, status in other.statuses.items():
            statuses[step_id] = worst(statuses.get(step_id, Status.OK), status)
        return KVTierWorkerMetadata(self.reported + other.reported, statuses, self.transfers + other.transfers)


_RANK = {Status.OK: 0, Status.FAILED: 1, Status.SOURCE_LOST: 2}


def worst(a: Status, b: Status) -> Status:
    return a if _RANK[a] >= _RANK[b] else b
