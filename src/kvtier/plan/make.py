"""One plan from its inputs: the GPU split, the tiers' sizes (from a trace when there is one), the host's RAM, and
the flags that deploy it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtier.plan import flags, tiers
from kvtier.plan.budget import (
    PROCESS_BYTES_PER_GPU,
    GiB,
    GpuPlan,
    HostPlan,
    host_available,
    plan_gpu,
    plan_host,
)
from kvtier.plan.model import ModelSpec, load_model
from kvtier.plan.presets import HUB_IDS, MODEL_CONFIGS
from kvtier.sim.cost import GB, CostModel, Link, ModelCompute, with_profile
from kvtier.sim.profile import load_profile

DEFAULT_BLOCK_TOKENS = 256


@dataclass
class PlanInputs:
    model: str = "llama-3.1-8b"
    weight_dtype: str | None = None
    kv_dtype: str | None = None  # None / "auto": the model's dtype
    tp: int = 1
    gpu_gib: float = 79.22  # what an 80 GB H100 reports as total memory
    gpu_util: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings, as vLLM does
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    engine_block_tokens: int = 16
    block_tokens: int | None = None  # kvtier's block; None: the trace's, else DEFAULT_BLOCK_TOKENS
    workspace_gib: float | None = None
    kv_cache_gib: float | None = None
    cpu_offload_gib: float = 0.0  # vLLM --cpu-offload-gb, per GPU
    host_gib: float = 512
    host_reserved_gib: float | None = None  # None: max(4 GiB, 5% of the host)
    process_gib: float | None = None  # None: PROCESS_BYTES_PER_GPU per GPU
    page_cache_gib: float = 0.0  # kvtier's disk tier uses O_DIRECT: it needs none
    slab_gib: float | None = None  # None: from the trace's knee, or all the host can give
    disk_gib: float = 0.0
    disk_root: str = "/mnt/kv_cache"
    trace: Path | None = None
    ttft_budget_ms: float = 2000
    profile: Path | None = None  # a calibrated profile: its measurements replace the stated defaults below
    tflops: float | None = None  # None: the stated default (400), or the profile's prefill fit
    pcie_gbs: float | None = None  # None: 25, or the profile's load from host
    disk_gbs: float | None = None  # None: 6, or the profile's load from disk
    itl_ms: float | None = None  # None: 20, or the profile's decode fit


@dataclass
class MemoryPlan:
    inputs: PlanInputs
    model: ModelSpec
    gpu: GpuPlan
    host: HostPlan
    sizes: tiers.TierSizes
    vllm_flags: str
    trtllm: str
    transfer_config: dict | None  # vLLM's --kv-transfer-config; None when the verdict is not to offload
    warnings: list[str] = field(default_factory=list)
    cost: CostModel | None = None  # what the latency check and the weight-offload warning priced with

    def as_dict(self) -> dict:
        i = self.inputs
        return {"model": self.model.name, "parameters": self.model.params.total,
                "weight_bytes_total": self.model.weight_bytes, "kv_bytes_per_token": self.model.layout.bytes_per_token,
                "tp": i.tp, "gpu": self.gpu.as_dict(), "host": self.host.as_dict(), "tiers": self.sizes.as_dict(),
                "offload": self.sizes.offload, "vllm_serve": self.vllm_flags,
                "kv_transfer_config": self.transfer_config, "trtllm_kv_cache_config": self.trtllm,
                "warnings": self.warnings, "cost_source": self.cost.sources() if self.cost else None,
                "inputs": {k: str(v) if isinstance(v, Path) else v for k, v in i.__dict__.items()}}


def make_plan(i: PlanInputs, on_request: Callable[[], None] | None = None) -> MemoryPlan:
    """`on_request` is called for each request the replay of a trace simulates (a progress bar)."""
    _check_inputs(i)
    model = load_model(i.model, i.weight_dtype, i.kv_dtype)
    cost, warnings = _cost(model, i)
    gpu = _gpu(i, model)
    host_budget = _host_budget(i)
    available = host_available(*host_budget)
    requests = _read(i) if i.trace is not None else None
    block_tokens = requests[0].block_tokens if requests else i.block_tokens or DEFAULT_BLOCK_TOKENS
    if block_tokens % i.engine_block_tokens:
        raise ValueError(f"--block-tokens {block_tokens} must be a multiple of --engine-block-tokens "
                         f"{i.engine_block_tokens}")
    # The tiers' sizes count the whole model's KV (as a trace's blocks do); the slab counts every rank's shard.
    kv_per_slab_byte = model.layout.bytes_per_token / (model.layout.shard(i.tp).bytes_per_token * i.tp)
    engine = gpu.kv_tokens * model.layout.bytes_per_token
    slab_fixed = None if i.slab_gib is None else int(i.slab_gib * GiB)
    disk = int(i.disk_gib * GiB * kv_per_slab_byte)  # every rank writes its own shard of a block to disk
    if requests:
        sizes = tiers.sizes_from_trace(requests, cost, engine, int(available * kv_per_slab_byte), disk,
                                       i.ttft_budget_ms / 1e3,
                                       None if slab_fixed is None else int(slab_fixed * kv_per_slab_byte),
                                       str(i.trace), on_request)
        slab_request = slab_fixed if slab_fixed is not None else int(sizes.host / kv_per_slab_byte)
    else:
        slab_request = slab_fixed if slab_fixed is not None else available
        sizes = tiers.sizes_without_trace(engine, int(slab_request * kv_per_slab_byte), disk)
    host = plan_host(model, i.tp, block_tokens, slab_request if sizes.offload else 0, *host_budget)
    sizes.host = int(host.slab_bytes * kv_per_slab_byte)
    transfer = None
    if sizes.offload:
        # cpu_bytes_to_use counts every rank's shards (as vLLM's offloading does); an fs tier's max_bytes one rank's
        disk_per_rank = int(sizes.disk / kv_per_slab_byte) // i.tp
        transfer = flags.kv_transfer_config(host, disk_per_rank, block_tokens, i.engine_block_tokens, i.disk_root)
    serve = flags.vllm_command(HUB_IDS.get(model.name, model.name), i.tp, gpu, i.gpu_util, i.max_num_seqs,
                               i.max_batched_tokens, transfer, i.cpu_offload_gib)
    trtllm = flags.trtllm_kv_cache_config(gpu, host if sizes.offload else None, i.tp)
    warning = flags.weight_offload_warning(int(i.cpu_offload_gib * GiB), cost.pcie.bytes_per_s, cost.itl_s)
    return MemoryPlan(i, model, gpu, host, sizes, serve, trtllm, transfer, [*warnings, *([warning] if warning else [])],
                      cost)


def _gpu(i: PlanInputs, model: ModelSpec) -> GpuPlan:
    max_model_len = i.max_model_len or model.max_position_embeddings
    if not max_model_len:
        raise ValueError(f"--max-model-len: {model.name} has no max_position_embeddings; pass one")
    return plan_gpu(model, i.tp, int(i.gpu_gib * GiB), i.gpu_util, max_model_len, i.max_num_seqs,
                    i.max_batched_tokens, i.engine_block_tokens, int(i.cpu_offload_gib * GiB),
                    None if i.workspace_gib is None else int(i.workspace_gib * GiB),
                    None if i.kv_cache_gib is None else int(i.kv_cache_gib * GiB))


def _host_budget(i: PlanInputs) -> tuple[int, int, int, int, int]:
    """(total, reserved, processes, offloaded weights, page cache) in bytes, as `plan_host` takes them."""
    total = int(i.host_gib * GiB)
    reserved = int(i.host_reserved_gib * GiB) if i.host_reserved_gib is not None else max(4 * GiB, total // 20)
    process = int(i.process_gib * GiB) if i.process_gib is not None else PROCESS_BYTES_PER_GPU * i.tp
    return total, reserved, process, int(i.cpu_offload_gib * GiB) * i.tp, int(i.page_cache_gib * GiB)


def _cost(model: ModelSpec, i: PlanInputs) -> tuple[CostModel, list[str]]:
    """The stated defaults, the figures the user gave, and a profile's measurements in place of both (a figure
    given and measured is an error, as is a profile of a model whose KV bytes per token differ); warnings."""
    cost = CostModel(model.layout, ModelCompute(model.params.active, model.attention_pair_flops()))
    if i.tflops is not None:
        cost = replace(cost, flops_per_s=i.tflops * 1e12)
    if i.pcie_gbs is not None:
        cost = replace(cost, pcie=Link("pcie", i.pcie_gbs * GB, cost.pcie.latency_s))
    if i.disk_gbs is not None:
        cost = replace(cost, disk=Link("disk", i.disk_gbs * GB, cost.disk.latency_s))
    if i.itl_ms is not None:
        cost = replace(cost, itl_s=i.itl_ms / 1e3)
    if i.profile is None:
        return cost, []
    given = [flag for flag, value in (("--tflops", i.tflops), ("--pcie-gbs", i.pcie_gbs), ("--disk-gbs", i.disk_gbs),
                                      ("--itl-ms", i.itl_ms)) if value is not None]
    return with_profile(cost, i.profile, given)


def profile_model(path: Path) -> str:
    """The model to plan for when --profile is given without --model: the profile's, as a preset (by its name or
    its hub id) or the local folder it was served from; ValueError asking for --model otherwise."""
    served = str(load_profile(path).server.get("model") or "")
    by_hub = {hub.lower(): name for name, hub in HUB_IDS.items()}
    if served in MODEL_CONFIGS:
        return served
    if served.lower() in by_hub:
        return by_hub[served.lower()]
    if served and (Path(served) / "config.json").is_file():
        return served
    raise ValueError(f"--profile {path}: its model {served or '(none named)'!r} is not a preset, a preset's hub id or "
                     "a folder with a config.json here; pass --model")


def _read(i: PlanInputs) -> list:
    from kvtier.traces.read import read_trace

    assert i.trace is not None
    if not i.trace.exists():
        raise ValueError(f"--trace {i.trace}: no such trace file or folder")
    requests = list(read_trace(i.trace, block_tokens=i.block_tokens))
    if not requests:
        raise ValueError(f"--trace {i.trace}: no requests")
    if len({r.block_tokens for r in requests}) > 1:
        raise ValueError(f"--trace {i.trace}: requests use different block sizes; plan one size at a time")
    return requests


def _check_inputs(i: PlanInputs) -> None:
    positive = {"--tp": i.tp, "--gpu-gib": i.gpu_gib, "--max-num-seqs": i.max_num_seqs,
                "--max-batched-tokens": i.max_batched_tokens, "--block-tokens": i.block_tokens,
                "--engine-block-tokens": i.engine_block_tokens, "--host-gib": i.host_gib,
                "--ttft-budget-ms": i.ttft_budget_ms, "--tflops": i.tflops, "--pcie-gbs": i.pcie_gbs,
                "--disk-gbs": i.disk_gbs}
    for flag, value in {**positive, "--max-model-len": i.max_model_len, "--slab-gib": i.slab_gib,
                        "--kv-cache-gib": i.kv_cache_gib}.items():
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}")
    for flag, value in {"--disk-gib": i.disk_gib, "--cpu-offload-gib": i.cpu_offload_gib,
                        "--host-reserved-gib": i.host_reserved_gib, "--page-cache-gib": i.page_cache_gib,
                        "--workspace-gib": i.workspace_gib, "--process-gib": i.process_gib,
                        "--itl-ms": i.itl_ms}.items():
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value:g}")
