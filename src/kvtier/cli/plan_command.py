"""`kvtier plan`: its arguments, and the hand-over to `kvtier.plan`. Bad input raises ValueError (exit code 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.cli.trace_commands import cost_flags
from kvtier.config import finite_float
from kvtier.plan.make import PlanInputs

HELP = "split the memory budget: weights, workspace, engine KV per GPU; then host and disk tiers, and the flags"
DESCRIPTION = """\
Splits the memory in vLLM's order before anything is offloaded: per GPU the weights, the runtime workspace and
the engine's KV (tokens, blocks, how many max-model-len sequences fit); then the host (the OS and other services,
the serving processes, weights offloaded with --cpu-offload-gb, the storage tier's page cache, kvtier's slab,
what stays free) and the disk. With --trace, the host and disk sizes sit at the knee of the trace's hit-ratio
curve, replayed through kvtier's directory, and the verdict says whether to offload at all. Prints the `vllm
serve` flags and TensorRT-LLM's KvCacheConfig. A plan that does not fit exits with code 2, naming the value.

Weight offload (--cpu-offload-gb) is not KV offload: it moves parameters to the host and copies them back in
every forward pass. KV offload moves attention state, and only when a prefix comes back."""


def add(sub: argparse._SubParsersAction) -> None:
    d = PlanInputs()
    p = sub.add_parser("plan", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a preset (llama-3.1-8b, llama-3-8b, llama-3.1-70b, qwen2.5-7b, "
                   "qwen2.5-72b, mistral-7b, deepseek-v3), an HF config.json or a folder holding one "
                   f"(default {d.model}; with --profile the profile's model)")
    p.add_argument("--weight-dtype", help="bf16, fp16, fp32, fp8, int8, int4 (default: the config's dtype, or its "
                   "quantization_config)")
    p.add_argument("--kv-dtype", help="vLLM's --kv-cache-dtype: auto, bf16, fp16, fp8 (default: the model's dtype)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor parallel size (default 1)")
    p.add_argument("--gpu-gib", type=finite_float, default=d.gpu_gib,
                   help="memory of one GPU as it reports it (default 79.22, an 80 GB H100)")
    p.add_argument("--gpu-util", type=finite_float, default=d.gpu_util,
                   help="vLLM's --gpu-memory-utilization (default 0.9)")
    p.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings, as vLLM")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="default 256")
    p.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens,
                   help="vLLM's --max-num-batched-tokens (default 8192)")
    p.add_argument("--engine-block-tokens", type=int, default=d.engine_block_tokens,
                   help="vLLM's --block-size (default 16; 128 on the CPU backend)")
    p.add_argument("--block-tokens", type=int, help="kvtier's block size (default: the trace's; 256 without one)")
    p.add_argument("--workspace-gib", type=finite_float, help="the workspace per GPU, instead of the stated assumption")
    p.add_argument("--kv-cache-gib", type=finite_float,
                   help="vLLM's --kv-cache-memory-bytes, in GiB: skips the profile")
    p.add_argument("--cpu-offload-gib", type=finite_float, default=0.0,
                   help="vLLM's --cpu-offload-gb (weight offload, per GPU): counted on the host, and warned about")
    p.add_argument("--host-gib", type=finite_float, default=d.host_gib, help="the host's RAM (default 512)")
    p.add_argument("--host-reserved-gib", type=finite_float,
                   help="RAM for the OS and co-located services (default: 5%% of the host, at least 4)")
    p.add_argument("--process-gib", type=finite_float, help="RAM of the serving processes (default 4 per GPU)")
    p.add_argument("--page-cache-gib", type=finite_float, default=0.0, help="page cache a buffered storage tier needs "
                   "(default 0: kvtier's disk tier uses O_DIRECT)")
    p.add_argument("--slab-gib", type=finite_float,
                   help="kvtier's host tier (cpu_bytes_to_use), all ranks (default: the "
                   "trace's knee, or all the host can give)")
    p.add_argument("--disk-gib", type=finite_float, default=0.0, help="disk space for the disk tier (default 0: none)")
    p.add_argument("--disk-root", default=d.disk_root,
                   help=f"the disk tier's folder in the flags (default {d.disk_root})")
    p.add_argument("--trace", type=Path, help="a trace in any format `kvtier analyze` reads: sizes at its knee")
    p.add_argument("--ttft-budget-ms", type=finite_float, default=d.ttft_budget_ms,
                   help="p99 TTFT budget (default 2000)")
    cost_flags(p, model_rule="; its model must have --model's KV bytes per token")
    p.add_argument("--itl-ms", type=finite_float, help="decode ms per output token (default 20)")
    p.add_argument("--measure", action="store_true", help="check the plan on this machine's vLLM CPU engine: start "
                   "--model (default: the tiny model, built here) with --kv-cache-gib (default 1) and compare the KV "
                   "blocks and weight bytes it allocates with the plan's")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--html", type=Path, help="write one page with the tables and a stacked bar per device")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.plan.make import make_plan, profile_model
    from kvtier.plan.present import plan_report

    if args.measure and args.profile is not None:
        raise ValueError("--profile: --measure checks the plan's memory, which no profile changes; pass one of them")
    if args.model is None:
        args.model = PlanInputs.model if args.profile is None else profile_model(args.profile)
    names = set(PlanInputs.__dataclass_fields__)
    inputs = PlanInputs(**{k: v for k, v in vars(args).items() if k in names})
    if args.measure:
        from kvtier.integrations.vllm.measure_plan import measure

        return measure(inputs, args.json)
    from kvtier.cli.trace_commands import progress_bar

    if inputs.trace is None:
        plan = make_plan(inputs)
    else:
        with progress_bar(Console(stderr=True), total=False) as progress:
            task = progress.add_task(f"replaying {inputs.trace.name} at the planned sizes", total=None)
            plan = make_plan(inputs, on_request=lambda: progress.advance(task))
    report = plan_report(plan)
    report.print(Console(width=max(Console().width, 140)))
    for path, write in ((args.json, report.write_json), (args.html, report.write_html)):
        if path:
            write(path)
            Console(stderr=True).print(f"wrote {path}")
    return 0
