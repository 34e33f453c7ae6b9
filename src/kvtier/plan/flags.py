"""The plan as the engines' own settings: `vllm serve` flags with kvtier's `--kv-transfer-config`, TensorRT-LLM's
`KvCacheConfig`, and what weight offload costs each forward pass when it is in play.

Weight offload (vLLM's --cpu-offload-gb) is not KV offload: it keeps model parameters on the host and copies them
to the GPU in every forward pass, prefill and each decode step alike; KV offload moves attention state only.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from kvtier.plan.budget import GiB, GpuPlan, HostPlan
from kvtier.sim.configs import CONNECTOR, DISK_ROOT, SimConfig


def kv_transfer_config(host: HostPlan, disk_bytes: int, block_tokens: int, engine_block_tokens: int,
                       disk_root: str = DISK_ROOT) -> dict:
    """vLLM's `--kv-transfer-config` for the plan, its kvtier part validated by the runtime's own config parser."""
    extra: dict = {"cpu_bytes_to_use": host.slab_bytes, "block_size": block_tokens,
                   "engine_block_size": engine_block_tokens}
    if disk_bytes > 0:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": disk_root, "max_bytes": disk_bytes}]
    with tempfile.TemporaryDirectory(prefix="kvtier-plan-") as scratch:
        SimConfig("plan", extra).validated(Path(scratch))
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def vllm_command(model: str, tp: int, gpu: GpuPlan, gpu_util: float, max_num_seqs: int, max_batched_tokens: int,
                 transfer: dict | None, cpu_offload_gib: float = 0) -> str:
    flags = ["vllm", "serve", model, "--tensor-parallel-size", str(tp), "--max-model-len", str(gpu.max_model_len),
             "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_batched_tokens),
             "--block-size", str(gpu.block_tokens), "--enable-prefix-caching"]
    if gpu.kv_cache_memory_given:
        flags += ["--kv-cache-memory-bytes", str(gpu.kv_bytes)]
    else:
        flags += ["--gpu-memory-utilization", f"{gpu_util:g}"]
    if cpu_offload_gib:
        flags += ["--cpu-offload-gb", f"{cpu_offload_gib:g}"]
    if transfer is not None:
        flags += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    return " ".join(shlex.quote(f) for f in flags)


def trtllm_kv_cache_config(gpu: GpuPlan, host: HostPlan | None, tp: int) -> str:
    """TensorRT-LLM's equivalent, per rank: its fraction counts the memory free after weights and workspace."""
    after_weights = gpu.total_bytes - gpu.weights_bytes - gpu.workspace_bytes
    fraction = min(1.0, gpu.kv_bytes / after_weights)
    host_cache = f", host_cache_size={host.slab_bytes // tp}" if host is not None else ""
    return (f"KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction={fraction:.3f}, "
            f"max_tokens={gpu.kv_tokens}{host_cache})")


def weight_offload_warning(cpu_offload_bytes: int, pcie_bytes_per_s: float, itl_s: float) -> str | None:
    """None without weight offload; else what it costs every forward pass."""
    if cpu_offload_bytes <= 0:
        return None
    per_forward = cpu_offload_bytes / pcie_bytes_per_s
    return (f"weight offload is in play (--cpu-offload-gb {cpu_offload_bytes / GiB:g} per GPU): those weights cross "
            f"PCIe in every forward pass, {1e3 * per_forward:,.0f} ms each at {pcie_bytes_per_s / 1e9:g} GB/s, "
            f"{per_forward / itl_s:,.1f}x a {1e3 * itl_s:g} ms decode step. It buys KV room at that price; KV "
            "offload (kvtier) moves attention state only, and only when a prefix comes back")
