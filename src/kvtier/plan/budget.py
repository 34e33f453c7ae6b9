"""The budget, in vLLM's order: weights, runtime workspace, engine KV per GPU; then the host (kvtier's slab beside
the process, the OS, other services and any page cache) and the disk.

vLLM profiles at startup: usable = total x gpu_memory_utilization, and KV = usable - weights - non-torch memory
- the activation peak of a dummy forward of `max_num_batched_tokens` tokens (`kv_cache_memory_bytes` skips the
profile). The plan cannot run that profile, so the workspace is an assumption, stated in `WORKSPACE_ASSUMPTION`
and overridable with `workspace_bytes`. A plan that does not fit raises ValueError naming the value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtier.layout import dtype_bytes, round_up
from kvtier.plan.model import ModelSpec

GiB = 1 << 30
NON_TORCH_BYTES = int(1.79 * GiB)  # one GPU: CUDA context, cuBLAS workspaces (vLLM's published H100 profile)
NON_TORCH_TP_FACTOR = 2  # with tensor parallelism, NCCL buffers double it (the same profile at TP 2: 3.58 GiB)
LOGIT_COPIES = 3  # the sampler's float32 logits, probabilities and log-probabilities of each sequence
WORKSPACE_ASSUMPTION = (
    "workspace = non-torch memory (1.79 GiB on one GPU, doubled with tensor parallelism: vLLM's published H100 "
    "profile) + an activation peak of max_num_batched_tokens x (4 x hidden + 3 x MLP width) activations "
    "+ max_num_seqs x vocab x 3 float32 logits, the same at any tp (as in that profile at TP 2); vision "
    "encoders and CUDA graphs are not counted: pass --workspace-gib for those"
)
PROCESS_BYTES_PER_GPU = 4 * GiB  # host memory of each serving worker: Python, torch, CUDA's host allocations


@dataclass(frozen=True)
class GpuPlan:
    """One GPU of a tensor-parallel group (every rank holds the same)."""

    total_bytes: int
    usable_bytes: int
    weights_bytes: int
    non_torch_bytes: int
    activation_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    block_tokens: int
    kv_blocks: int
    max_model_len: int
    kv_cache_memory_given: bool  # kv_cache_memory_bytes set: no profile, the KV is what was asked

    @property
    def workspace_bytes(self) -> int:
        return self.non_torch_bytes + self.activation_bytes

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_tokens

    @property
    def max_model_len_sequences(self) -> float:
        return self.kv_tokens / self.max_model_len

    @property
    def free_bytes(self) -> int:
        return self.usable_bytes - self.weights_bytes - self.workspace_bytes - self.kv_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "workspace_bytes": self.workspace_bytes, "kv_tokens": self.kv_tokens,
                "max_model_len_sequences": self.max_model_len_sequences}


def activation_peak(model: ModelSpec, max_batched_tokens: int, max_num_seqs: int) -> int:
    forward = max_batched_tokens * dtype_bytes(model.dtype) * (4 * model.hidden + 3 * model.mlp_width)
    logits = max_num_seqs * model.vocab * 4 * LOGIT_COPIES
    return forward + logits


def plan_gpu(model: ModelSpec, tp: int, gpu_bytes: int, gpu_util: float, max_model_len: int, max_num_seqs: int,
             max_batched_tokens: int, block_tokens: int, cpu_offload_bytes: int = 0,
             workspace_bytes: int | None = None, kv_cache_bytes: int | None = None) -> GpuPlan:
    """One GPU's split. `cpu_offload_bytes`: weights vLLM's --cpu-offload-gb keeps on the host, per GPU."""
    if not 0 < gpu_util <= 1:
        raise ValueError(f"--gpu-util must be in (0, 1], got {gpu_util}")
    usable = int(gpu_bytes * gpu_util)
    weights = max(0, -(-model.weight_bytes // tp) - cpu_offload_bytes)
    layout = model.layout.shard(tp)
    if workspace_bytes is None:
        non_torch = NON_TORCH_BYTES * (NON_TORCH_TP_FACTOR if tp > 1 else 1)
        activation = activation_peak(model, max_batched_tokens, max_num_seqs)
    else:
        non_torch, activation = workspace_bytes, 0
    kv = usable - weights - non_torch - activation if kv_cache_bytes is None else kv_cache_bytes
    if kv_cache_bytes is None and kv <= 0:
        raise ValueError(
            f"--model {model.name} does not fit the GPU: {gpu_bytes / GiB:.2f} GiB x --gpu-util {gpu_util} = "
            f"{usable / GiB:.2f} GiB usable, but weights take {weights / GiB:.2f} GiB per GPU (tp {tp}) and the "
            f"workspace {(non_torch + activation) / GiB:.2f} GiB, leaving {kv / GiB:.2f} GiB for KV")
    page = layout.bytes_per_block(block_tokens)
    blocks = kv // page
    if blocks * block_tokens < max_model_len:
        raise ValueError(
            f"--max-model-len {max_model_len}: the engine's KV ({kv / GiB:.2f} GiB per GPU, {blocks * block_tokens:,} "
            f"tokens) cannot hold one sequence of that length; vLLM refuses to start")
    if kv_cache_bytes is not None and weights + non_torch + activation + kv > gpu_bytes:
        raise ValueError(
            f"--kv-cache-gib {kv / GiB:.2f}: with weights {weights / GiB:.2f} GiB and workspace "
            f"{(non_torch + activation) / GiB:.2f} GiB it is over the GPU's {gpu_bytes / GiB:.2f} GiB")
    return GpuPlan(gpu_bytes, usable, weights, non_torch, activation, kv, layout.bytes_per_token, block_tokens,
                   blocks, max_model_len, kv_cache_bytes is not None)


@dataclass(frozen=True)
class HostPlan:
    """The host's RAM, in the order it is claimed."""

    total_bytes: int
    reserved_bytes: int  # the OS and co-located services
    process_bytes: int  # the serving workers themselves
    offloaded_weights_bytes: int  # vLLM --cpu-offload-gb, all GPUs
    page_cache_bytes: int  # what a buffered storage tier keeps in the page cache
    slab_bytes: int  # kvtier's host tier: exact, slots x slot size, over every rank
    slab_slots_per_rank: int
    slot_bytes: int
    pinned_pow2_bytes: int  # what one pinned torch tensor of the same size would reserve

    @property
    def available_bytes(self) -> int:
        """What the slab may take."""
        return (self.total_bytes - self.reserved_bytes - self.process_bytes - self.offloaded_weights_bytes
                - self.page_cache_bytes)

    @property
    def free_bytes(self) -> int:
        return self.available_bytes - self.slab_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "available_bytes": self.available_bytes, "free_bytes": self.free_bytes}


def host_available(total: int, reserved: int, process: int, offloaded: int, page_cache: int) -> int:
    """What the host can give the slab; ValueError when the rest already takes it all."""
    available = total - reserved - process - offloaded - page_cache
    if available <= 0:
        raise ValueError(
            f"--host-gib {total / GiB:g}: the host is already spent before any tier (reserved {reserved / GiB:g}, "
            f"serving processes {process / GiB:g}, offloaded weights {offloaded / GiB:g}, page cache "
            f"{page_cache / GiB:g} GiB)")
    return available


def plan_host(model: ModelSpec, tp: int, block_tokens: int, slab_request: int, total: int, reserved: int,
              process: int, offloaded: int, page_cache: int) -> HostPlan:
    """The slab for `slab_request` bytes over all ranks (kvtier's cpu_bytes_to_use): whole slots of one kvtier
    block each, page-aligned, in one mmap per rank; never rounded to a power of two. 0: no host tier."""
    available = host_available(total, reserved, process, offloaded, page_cache)
    slot = round_up(model.layout.shard(tp).bytes_per_block(block_tokens))
    slots = slab_request // tp // slot
    if slots < 1 and slab_request > 0:
        raise ValueError(f"--slab-gib {slab_request / GiB:g}: holds no block of {slot:,} B per rank (tp {tp})")
    slab = slots * slot * tp
    if slab > available:
        raise ValueError(
            f"--slab-gib {slab_request / GiB:g}: the host budget cannot hold it: {total / GiB:g} GiB less reserved "
            f"{reserved / GiB:g}, processes {process / GiB:g}, offloaded weights {offloaded / GiB:g} and page cache "
            f"{page_cache / GiB:g} leaves {available / GiB:.2f} GiB")
    return HostPlan(total, reserved, process, offloaded, page_cache, slab, slots, slot,
                    tp * (1 << (slots * slot - 1).bit_length()) if slots else 0)
