"""The decide-before-you-deploy commands: `kvtier generate`, `kvtier analyze`, `kvtier simulate`.

Argument parsing lives here, next to what the commands do, so that `kvtier.cli` only hands over. Heavy
imports happen inside the commands: `kvtier --help` stays fast. Bad input raises ValueError (a TraceError
names file, line and field) or ConfigError; the CLI turns both into exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from kvtier.config import finite_float

if TYPE_CHECKING:
    from kvtier.sim.cost import CostModel

COMMANDS = ("generate", "analyze", "simulate")
GiB = 1 << 30

HELP = """\
  generate write a seeded synthetic trace (shared prefixes, RAG, sessions, unique prompts) as kvtier JSONL
  analyze  the four questions of a trace (what is shared, when it comes back, block size, one-shot blocks)
           and a verdict: does tiering fit this traffic, and why
  simulate replay a trace through kvtier's directory on a virtual clock, several configurations side by side,
           and print the one to deploy as --kv-transfer-config JSON
"""


def cost_flags(p: argparse.ArgumentParser, model_rule: str = "") -> None:
    """The cost model's flags of every planning command: a profile, or the stated figures it replaces."""
    p.add_argument("--profile", type=Path, metavar="FILE", help="a profile `kvtier calibrate` measured: its prefill, "
                   "decode and tier-load fits replace the stated defaults below (a flag below for a figure it "
                   "measured is an error; one for a figure it did not measure applies)" + model_rule)
    p.add_argument("--tflops", type=finite_float, help="effective prefill TFLOP/s (default 400)")
    p.add_argument("--pcie-gbs", type=finite_float, help="host <-> GPU GB/s (default 25)")
    p.add_argument("--disk-gbs", type=finite_float, help="NVMe read GB/s (default 6)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    from kvtier.layout import PRESETS

    gen = sub.add_parser("generate", help="write a seeded synthetic trace as kvtier JSONL",
                         description="Workloads with known parameters: what `kvtier analyze` reports about them "
                         "should match what was asked for (e.g. the mean think time of sessions).")
    gen.add_argument("kind", choices=["shared", "unique", "sessions", "rag", "system"],
                     help="shared: a mix of system prompts, RAG, sessions and unique prompts; the others one kind")
    gen.add_argument("output", type=Path, help="the .jsonl file to write")
    gen.add_argument("--requests", type=int, default=2000, help="requests (default 2000)")
    gen.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    gen.add_argument("--rate", type=finite_float, default=2.0,
                     help="arrivals of new conversations per second (default 2)")
    gen.add_argument("--think-time", type=finite_float, default=30.0,
                     help="mean seconds between a session's turns, exponential (default 30)")
    gen.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")

    def deployment(p: argparse.ArgumentParser) -> None:
        p.add_argument("trace", type=Path, help="Mooncake JSONL, kvtier JSONL, Azure 2023 CSV or a kv-cache-tester "
                       "agentic trace (a .json per conversation, a folder of them, or JSONL); the format is detected")
        p.add_argument("--model", choices=sorted(PRESETS), help="layout preset (default llama-3.1-8b; with --profile "
                       "the profile's model, and a --model whose KV bytes per token differ from it is an error)")
        p.add_argument("--engine-kv-gib", type=finite_float, default=40,
                       help="the engine's KV cache memory (default 40)")
        p.add_argument("--host-gib", type=finite_float, default=256, help="host tier size (default 256)")
        p.add_argument("--disk-gib", type=finite_float, default=2048, help="disk tier size (default 2048)")
        cost_flags(p)
        p.add_argument("--network-gbs", type=finite_float, help="network GB/s (default 12.5 = 100 Gbit/s)")
        p.add_argument("--block-tokens", type=int, help="block size for kvtier `tokens` and CSV traces")
        p.add_argument("--json", type=Path, help="write every figure to this file")
        p.add_argument("--html", type=Path, help="write one self-contained page with tables and plots")

    analyze = sub.add_parser("analyze", help="does tiering fit this traffic? the four questions and a verdict",
                             description="Reads the trace once: shared prefixes, reuse time and distance, a block "
                             "size table, one-shot blocks, the LRU miss-ratio curve, and a verdict with reasons.")
    deployment(analyze)
    analyze.add_argument("--ttft-budget-ms", type=finite_float, default=2000, help="p99 TTFT budget (default 2000)")

    simulate = sub.add_parser("simulate", help="replay a trace through kvtier configurations; recommend one",
                              description="Replays the trace through kvtier's directory (the runtime's own code) "
                              "behind an LRU engine cache, on a virtual clock with a cost model. Without --config: "
                              "engine only, + host (lru, arc, s3fifo, 2nd-sighting admission; priority when the "
                              "trace has priorities), + host + disk (its admission auto: on the 1st sighting while "
                              "blocks come back; and always on the 1st).")
    deployment(simulate)
    simulate.add_argument("--config", type=Path, action="append", metavar="FILE",
                          help="a kvtier config JSON (or a whole --kv-transfer-config); repeat to compare several")
    simulate.add_argument("--instances", type=int, help="prefill servers (default: recomputing every prompt "
                          "would keep them 70%% busy)")
    simulate.add_argument("--itl-ms", type=finite_float, help="decode ms per output token (default 20)")
    simulate.add_argument("--guard", metavar="JSON", help="run the guard (the rollback rule) in every configuration "
                          "with tiers: the config's `guard` object, e.g. '{\"ttft_p99_ms\": 2000, \"window_s\": 60}' "
                          "(or a file holding it); the report says when it turned a tier off")


def run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "analyze":
        return _analyze(args)
    return _simulate(args)


def _generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvtier.traces.workloads import GENERATORS, generate_trace
    from kvtier.traces.write import write_kvtier_jsonl

    workload = replace(GENERATORS[args.kind], requests=args.requests, seed=args.seed, rate_per_s=args.rate,
                       think_time_s=args.think_time, block_tokens=args.block_tokens)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    n = write_kvtier_jsonl(generate_trace(workload), args.output)
    Console(stderr=True).print(f"wrote {n:,} requests to {args.output} ({workload})")
    return 0


STATED = ("tflops", "pcie_gbs", "disk_gbs", "network_gbs", "itl_ms")  # flags of the cost model's stated defaults


def _cost(args: argparse.Namespace) -> tuple[CostModel, list[str]]:
    """The cost model: `cost_model`'s defaults, the flags the user gave, and a --profile's measurements in place of
    both (`with_profile`: a flag for a figure the profile measured is an error); warnings for the report."""
    from kvtier.sim.cost import cost_model, with_profile

    for name in ("engine_kv_gib", "host_gib", "disk_gib"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    given = {name: getattr(args, name) for name in STATED if getattr(args, name, None) is not None}
    cost = cost_model(args.model or "llama-3.1-8b", **given)
    if args.profile is None:
        return cost, []
    return with_profile(cost, args.profile, [f"--{name.replace('_', '-')}" for name in given],
                        model_given=args.model is not None)


def _requests(args: argparse.Namespace):
    """The trace's request stream, and notes on how it was read."""
    from kvtier.traces.read import read_trace, trace_format

    if not args.trace.exists():
        raise ValueError(f"{args.trace}: no such trace file or folder")
    notes = []
    if trace_format(args.trace) == "azure":
        from kvtier.traces.azure import SyntheticReuse

        reuse = SyntheticReuse(block_tokens=args.block_tokens or SyntheticReuse().block_tokens)
        notes.append(f"length-only trace: every reuse figure is the model's, not the traffic's ({reuse.describe()})")
    return read_trace(args.trace, block_tokens=args.block_tokens), notes


def progress_bar(console: Console, total: bool) -> Progress:
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn() if total else TextColumn("{task.completed:,} requests"), TimeElapsedColumn()]
    return Progress(*columns, console=console, transient=True)


def _analyze(args: argparse.Namespace) -> int:
    from kvtier.analyze.present import analysis_report
    from kvtier.analyze.questions import Deployment, analyze
    from kvtier.report import Text

    if args.ttft_budget_ms <= 0:
        raise ValueError(f"--ttft-budget-ms must be > 0, got {args.ttft_budget_ms}")
    cost, warnings = _cost(args)
    deployment = Deployment(cost, int(args.engine_kv_gib * GiB), int(args.host_gib * GiB),
                            int(args.disk_gib * GiB), args.ttft_budget_ms / 1e3)
    started = time.perf_counter()
    requests, notes = _requests(args)
    err = Console(stderr=True)
    with progress_bar(err, total=False) as progress:
        task = progress.add_task(f"reading {args.trace.name}", total=None)

        def counted():
            for i, request in enumerate(requests, 1):
                if not i % 1000:
                    progress.update(task, completed=i)
                yield request

        analysis = analyze(counted(), deployment, str(args.trace))
        report = analysis_report(analysis, warnings)
    report.parts[1:1] = [Text(f"note: {n}", "yellow") for n in notes]
    report.data["notes"] = notes
    report.data["seconds"] = time.perf_counter() - started
    _emit(report, args)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from kvtier.config import parse_guard
    from kvtier.sim.configs import SimConfig, builtin_configs, load_config_file
    from kvtier.sim.present import simulation_report
    from kvtier.sim.simulate import ServingSetup, auto_instances, simulate

    if args.instances is not None and args.instances <= 0:
        raise ValueError(f"--instances must be > 0, got {args.instances}")
    cost, warnings = _cost(args)
    configs = [load_config_file(path) for path in args.config or []]
    guard = parse_guard(args.guard) if args.guard else None
    logging.getLogger("kvtier.guard").setLevel(logging.ERROR)  # simulated transitions go in the report, not the log
    started = time.perf_counter()
    stream, notes = _requests(args)
    requests = list(stream)
    if not requests:
        raise ValueError(f"{args.trace}: no requests")
    sizes = {r.block_tokens for r in requests}
    if len(sizes) > 1:
        raise ValueError(f"{args.trace}: requests use different block sizes {sorted(sizes)}; simulate one at a time")
    block_tokens = sizes.pop()
    if configs:
        configs.insert(0, SimConfig("engine only", None))  # the baseline every config is judged against
        for c in configs[1:]:
            if c.extra and c.extra.get("block_size", 256) != block_tokens:
                notes.append(f"{c.name}: block_size {c.extra.get('block_size', 256)} differs from the trace's "
                             f"{block_tokens} tokens per block; simulated at the trace's block size")
    else:
        configs = builtin_configs(block_tokens, int(args.host_gib * GiB), int(args.disk_gib * GiB),
                                  any(r.priority is not None for r in requests))
    setup = ServingSetup(cost, block_tokens, int(args.engine_kv_gib * GiB),
                         args.instances or auto_instances(requests, cost))
    err = Console(stderr=True)
    with progress_bar(err, total=True) as progress:
        task = progress.add_task(f"replaying {len(configs)} configurations", total=len(requests) * len(configs))
        step = [0]

        def advance() -> None:
            step[0] += 1
            if not step[0] % 500:
                progress.update(task, completed=step[0])

        results = simulate(requests, configs, setup, on_request=advance, guard=guard)
    report = simulation_report(str(args.trace), results, setup, notes, warnings)
    report.data["seconds"] = time.perf_counter() - started
    _emit(report, args)
    return 0


def _emit(report, args: argparse.Namespace) -> None:
    report.print(Console(width=max(Console().width, 140)))
    if args.json:
        report.write_json(args.json)
    if args.html:
        report.write_html(args.html)
    done = [str(p) for p in (args.json, args.html) if p]
    if done:
        Console(stderr=True).print(f"wrote {', '.join(done)}")
