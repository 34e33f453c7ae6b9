"""The connector's halves wired in-process as vLLM drives them, with every rank's real stores and a model of the
engine's KV memory whose content is known: a block's bytes on rank r are a function of its key and r.

vLLM's call order per request: `get_num_new_matched_tokens`, `update_state_after_alloc`, then each step
`build_connector_meta` -> every worker's `start_load_kv` -> the forward -> `get_finished`,
`get_block_ids_with_load_errors`, `build_connector_worker_meta` (aggregated over ranks) ->
`update_connector_output`; `request_finished` when it ends (or is aborted). With more than one rank, what travels
between the halves is pickled, as vLLM's multiprocess executor sends it. Checked on every load: an engine block
the workers did not report as failed holds exactly its key's bytes on every rank (`wrong`: the count of blocks
that did not, which must stay 0).
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TypeVar

import torch

from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.worker import WorkerSide

T = TypeVar("T")
P = 4096  # bytes of one engine block (one layer), which is one kvtier block of 16 tokens
TOKENS = 16


def geometry(world_size: int) -> Geometry:
    return Geometry(engine_block_size=TOKENS, block_tokens=TOKENS, engine_block_nbytes=P, world_size=world_size,
                    model="harness", dtype="bf16", kv_layout="x", hash_algo="sha256", tenant_salt="")


def content(block_hash: bytes, rank: int) -> torch.Tensor:
    """What the engine computes for a block on a rank: different blocks and ranks never look alike."""
    seed = int.from_bytes(hashlib.blake2b(block_hash + bytes([rank]), digest_size=8).digest(), "little") >> 1
    return torch.randint(0, 256, (P,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# What the scheduler half reads of vLLM's SchedulerOutput: no request scheduled for the first time, work to do.
STEP = SimpleNamespace(scheduled_new_reqs=[], total_num_scheduled_tokens=1)


@dataclass
class Request:
    request_id: str
    block_hashes: list[bytes]
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    promised: int = 0
    is_async: bool = False
    num_output_tokens: int = 0
    arrival_time: float = 0.0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return TOKENS * len(self.block_hashes) + 1

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens


def loading_all(config: KVTierConfig) -> KVTierConfig:
    """These tests are about what a load delivers, not whether it is worth it: every block found is loaded."""
    return config.model_copy(update={"load_policy": "always"})


class Engine:
    def __init__(self, config, world_size: int = 1, num_blocks: int = 64, lagging: float = 0.0, seed: int = 0) -> None:
        """`lagging`: the share of steps in which a rank (not rank 0) reports before its background work is done,
        so that ranks report one step's work in different steps, as they do in a busy engine."""
        geo = geometry(world_size)
        self.workers = [WorkerSide(config, geo, rank) for rank in range(world_size)]
        self.kv = [torch.zeros(num_blocks, P, dtype=torch.uint8) for _ in self.workers]
        for worker, kv in zip(self.workers, self.kv):  # before the scheduler half, as vLLM does
            worker.register_kv_caches({"layer0": kv}, num_blocks)
        self.scheduler = SchedulerSide(loading_all(config), geo)
        self.free = list(range(num_blocks))
        self.held: dict[str, Request] = {}  # finished requests whose blocks wait for their stores
        self.recving: dict[str, int] = {}  # request id -> ranks that reported its asynchronous load
        self.sending: dict[str, int] = {}  # request id -> ranks that reported its stores done
        self.loaded = self.wrong = self.checked = 0
        self.lagging, self.rng = lagging, random.Random(seed)

    # ---------------------------------------------------------------- vLLM's side of one request

    def admit(self, request: Request) -> bool:
        """Lookup and allocation; False when the engine has no room for it (it waits, as in vLLM)."""
        promised, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        if promised is None:
            return False
        if len(self.free) < len(request.block_hashes):
            self.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
            return False
        request.blocks = [self.free.pop() for _ in request.block_hashes]
        request.promised, request.is_async = promised, is_async
        self.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (request.blocks,)),
                                                promised)
        request.num_computed_tokens = promised
        return True

    def admit_when_answered(self, request: Request, step: bool = True) -> Request:
        """As vLLM does: the request waits until its lookup (a shared tier's, on a thread) has an answer and it gets
        its blocks; meanwhile the engine steps (`step=False`: work planned stays unrun, as a test may need)."""
        for _ in range(500):
            if self.admit(request):
                return request
            if step:
                self.step()
            time.sleep(0.005)
        raise AssertionError(f"{request.request_id} was never admitted")

    def run(self, request: Request, abort_before_output: bool = False) -> None:
        """The steps that load the request's prefix and compute the rest, then its end."""
        invalid = self.step(finish=[request] if abort_before_output else [])
        if abort_before_output:
            return
        if request.is_async:  # vLLM waits for the load to be reported before it schedules the request
            for _ in range(500):
                if self.recving.get(request.request_id, 0) == len(self.workers):
                    break
                invalid |= self.step()
                time.sleep(0.002)
            else:
                raise AssertionError(f"{request.request_id}: its load was never reported")
        self.check_loaded(request, invalid)
        self.compute(request, invalid)
        request.num_computed_tokens = TOKENS * len(request.block_hashes)
        self.finish(request)

    def finish(self, request: Request) -> None:
        holds, _ = self.scheduler.request_finished(request, request.blocks)
        if holds:
            self.held[request.request_id] = request
        elif not request.is_async or self.recving.get(request.request_id, 0) == len(self.workers):
            self.free.extend(request.blocks)
        else:  # aborted while loading: vLLM frees its blocks once the load is reported
            self.held[request.request_id] = request

    # ---------------------------------------------------------------- one engine step

    def step(self, finish: list[Request] = ()) -> set[int]:
        """Metadata down, every worker's work, outputs up (`finish`: requests aborted in between, as vLLM
        processes aborts after the step ran and before its output is handled). Returns the failed blocks."""
        meta = self.scheduler.build_connector_meta(STEP)
        for worker in self.workers:
            worker.start(self._sent(meta))
        for request in finish:
            self.finish(request)
        metas, sending, recving, invalid = [], [], [], set()
        for rank, worker in enumerate(self.workers):
            if rank == 0 or self.rng.random() >= self.lagging:
                worker.mover.flush()
            s, r = worker.get_finished(set())
            sending.append(s or set())
            recving.append(r or set())
            invalid |= worker.get_block_ids_with_load_errors()
            metas.append(self._sent(worker.worker_meta()))
        merged = None
        for m in metas:
            if m is not None:
                merged = m if merged is None else merged.aggregate(m)
        done = self._received(recving)
        self.scheduler.update_connector_output(merged or KVTierWorkerMetadata(), done)
        self._release(sending, done)
        return invalid

    def _sent(self, message: T) -> T:
        """`message` as the other half gets it: pickled and unpickled where vLLM runs its ranks in processes of
        their own (its multiprocess executor, for more than one), the object itself where it runs one in-process."""
        return message if len(self.workers) == 1 else pickle.loads(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def _received(self, recving: list[set[str]]) -> set[str]:
        """The requests whose loads every rank has now reported."""
        done = set()
        for r in recving:
            for request_id in r:
                self.recving[request_id] = self.recving.get(request_id, 0) + 1
                if self.recving[request_id] == len(self.workers):
                    done.add(request_id)
        return done

    def _release(self, sending: list[set[str]], done: set[str]) -> None:
        """vLLM frees a held request's blocks once every rank reported its store sent, or its load in."""
        for request_id in set().union(*sending):
            self.sending[request_id] = self.sending.get(request_id, 0) + sum(request_id in x for x in sending)
            if self.sending[request_id] == len(self.workers) and request_id in self.held:
                self.free.extend(self.held.pop(request_id).blocks)
        for request_id in done & set(self.held):  # an aborted request's load came in: its blocks go
            if request_id not in self.sending:
                self.free.extend(self.held.pop(request_id).blocks)

    def drain(self, steps: int = 200) -> None:
        for _ in range(steps):
            self.step()
            if not self.held and not self.scheduler.has_pending_work():
                return
            time.sleep(0.002)
        raise AssertionError(f"stores never drained: held {sorted(self.held)}")

    # ---------------------------------------------------------------- the engine's KV

    def check_loaded(self, request: Request, invalid: set[int]) -> None:
        for i in range(request.promised // TOKENS):
            block = request.blocks[i]
            if block in invalid:
                continue
            self.loaded += 1
            for rank, kv in enumerate(self.kv):
                self.checked += 1
                if not torch.equal(kv[block], content(request.block_hashes[i], rank)):
                    self.wrong += 1

    def compute(self, request: Request, invalid: set[int]) -> None:
        for i, block in enumerate(request.blocks):
            if i >= request.promised // TOKENS or block in invalid:
                for rank, kv in enumerate(self.kv):
                    kv[block] = content(request.block_hashes[i], rank)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
