"""KVTierConnector: kvtier as a vLLM KV connector (KVConnectorBase_V1).

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592}}'

One instance runs in the scheduler (the directory: `SchedulerSide`), one in every worker (stores and mover:
`WorkerSide`). Plans go down in the connector metadata; step completions come back in the worker metadata.
A failed load is reported through `get_block_ids_with_load_errors`, and the connector sets vLLM's
`kv_load_failure_policy` to "recompute": a cache miss must cost time, never a request.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.setup import geometry, read_config
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.stores.base import TierKind

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


def _log_as_vllm() -> None:
    """kvtier's lines (what it configured and recovered, the guard's transitions) in the engine's log, through
    vLLM's own handlers and level: operators read one log."""
    ours, engine = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not ours.handlers and engine.handlers:
        for handler in engine.handlers:
            ours.addHandler(handler)
        ours.setLevel(engine.getEffectiveLevel())
        ours.propagate = False


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        _log_as_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        config = read_config(vllm_config)  # a bad value stops the engine here, naming the field
        geo = geometry(vllm_config, kv_cache_config, config)
        self._num_blocks = kv_cache_config.num_blocks
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvtier.integrations.vllm.scheduler import SchedulerSide

            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            events = vllm_config.kv_events_config
            self._scheduler = SchedulerSide(config, geo, kv_events=bool(events and events.enable_kv_cache_events))
        else:
            from vllm.distributed.parallel_state import get_world_group

            from kvtier.integrations.vllm.worker import WorkerSide

            self._worker = WorkerSide(config, geo, rank=get_world_group().rank_in_group)

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """This instance's scheduler half (None in a worker): the directory, its control and its figures."""
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide | None:
        """This instance's worker half (None in the scheduler): stores, mover and their metrics."""
        return self._worker

    def _scheduler_half(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvtier: a scheduler hook was called on a worker's connector")
        return self._scheduler

    def _worker_half(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvtier: a worker hook was called on the scheduler's connector")
        return self._worker

    # ---------------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_half().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        assert meta is None or isinstance(meta, KVTierWorkerMetadata)
        self._scheduler_half().update_connector_output(meta, connector_output.finished_recving)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's `vllm:prompt_tokens_cached_by_source`: host and disk hits under their names; the shared tier, a
        remote store, under `external_unspecified` (vLLM has no name for it). Tokens found at lookup that the load
        plan could not cover (evicted in between) are recomputed, so they are in no source."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        names = {TierKind.HOST: CacheHitSource.HOST, TierKind.DISK: CacheHitSource.DISK}
        sources: Counter = Counter()
        for kind, tokens in self._scheduler_half().served_by_kind(request.request_id).items():
            sources[names.get(kind, CacheHitSource.EXTERNAL_UNSPECIFIED)] += tokens
        return {source: n for source, n in sources.items() if n > 0}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half().request_finished(request, block_ids)

    def take_events(self) -> list[Any]:
        """kvtier's BlockStored / BlockRemoved since the last call (`kvtier.integrations.vllm.events`)."""
        events = self._scheduler.events if self._scheduler is not None else None
        return events.take() if events is not None else []

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # ---------------------------------------------------------------- worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_half().register_kv_caches(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker_half().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous: vLLM waits for finished_recving

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # stores copy finished requests' blocks, which vLLM holds for us

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker_half().wait_if_idle(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_half().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_half().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_half().worker_meta()

    # ---------------------------------------------------------------- stats (both halves; vLLM aggregates them)

    def get_kv_connector_stats(self) -> KVTierStats | None:
        half: SchedulerSide | WorkerSide = self._scheduler or self._worker_half()
        stats = KVTierStats(half.stats_payload())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


__all__ = ["KVTierConnector", "KVTierWorkerMetadata"]
