"""The `kvtier` command. Bad input exits with code 2 and a message that names the field, file or value."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier import __version__
from kvtier.cli import calibrate_command, plan_command, rollout_command, trace_commands
from kvtier.config import ConfigError, for_engine, parse_config

EXIT_BAD_INPUT = 2
MODULES = {"plan": plan_command, "calibrate": calibrate_command}  # commands whose module runs them

DESCRIPTION = """\
kvtier keeps the KV cache of LLM serving in tiers: the engine's memory (hot) -> host DRAM (warm) ->
local disk and a shared Redis (cold). Reusable prefixes come back from a tier instead of being recomputed.

commands:
  rollout  the seven-step rollout against a real server over HTTP (`vllm serve`, or your own command)
  demo     the rollout on the embedded default: `vllm serve` with a tiny model on this CPU, every step
  bench    measure the tiers against plain baselines on this machine (ratios, medians of several runs)
  config   validate a kvtier config file (the JSON you pass as kv_connector_extra_config)
  plan     split the memory budget (weights, workspace, engine KV; host and disk tiers) and print the flags
  calibrate  measure your engine (prefill, decode) and this machine's tiers into a profile for --profile
  tiny-model  write a servable tiny model (random weights, a locally trained tokenizer, a chat template)
""" + trace_commands.HELP


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="the rollout on the embedded default (vllm serve, tiny model, this CPU)",
                          description="`kvtier rollout` with every step on the embedded default: builds a tiny "
                          "random-weight Llama and a tokenizer locally, serves it with `vllm serve` on the CPU and "
                          "sends the built-in mix (a hot set of system prompts and RAG documents, multi-turn sessions "
                          "that come back after longer gaps, unique prompts) over HTTP: reference, baseline, headroom "
                          "and the tiers' sizes, + host, + host and disk with its drills, and the rollback drill. "
                          "Exit code 1 if a request served from a tier differs from the reference with the same "
                          "cached KV lineage, or a drill fails.")
    rollout_command.common(demo, requests=40)
    demo.set_defaults(html=Path("out/demo.html"))
    demo.add_argument("--in-process", action="store_true", help="no vLLM: the same tiers behind an in-process "
                      "engine stand-in (TieredCache), every restored block checked against recomputation")
    demo.add_argument("--config", type=Path, help="with --in-process: a kvtier config JSON to compare with "
                      "'engine only' instead of the built-in configurations")
    rollout_command.add(sub)

    bench = sub.add_parser("bench", help="tier throughput and lookup speed as ratios against baselines",
                           description="host tier vs torch copy_, disk tier vs raw O_DIRECT I/O on the same file "
                           "system, directory lookups per second. Medians of several runs.")
    bench.add_argument("--json", type=Path, help="write every figure to this file")
    bench.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not a measurement")
    bench.add_argument("--root", type=Path, help="directory for the disk benchmarks (default: system temp dir)")
    bench.add_argument("--vllm", action="store_true", help="TTFT ratios on a real vLLM engine (CPU, tiny model): "
                       "host and disk restores vs recompute and vs vLLM's own cache hit; no-reuse p99 on vs off")
    bench.add_argument("--redis", action="store_true", help="only the shared tier's figures: one redis-server "
                       "(redis_vs_raw) and a 6-node loopback Redis Cluster (redis_cluster_vs_raw, the spread over "
                       "primaries on the Mooncake conversation trace, a lookup against one node's)")

    config = sub.add_parser("config", help="validate a config file and print it with defaults filled in")
    config.add_argument("file", type=Path, help="the kv_connector_extra_config JSON, or a whole --kv-transfer-config")
    config.add_argument("--block-size", type=int, metavar="TOKENS",
                        help="vLLM's --block-size (its default: 16 on GPUs, 128 on the CPU backend): print the values "
                        "kvtier will use inside that engine (block_size defaults to it)")
    tiny = sub.add_parser("tiny-model",
                          help="write a servable tiny Llama: random weights, a tokenizer, a chat template",
                          description="Builds, without downloading anything, the model the tests, bench and demo "
                          "serve: a 4-layer Llama with random weights and a tokenizer built here (deterministic: whole "
                          "pseudo-words, bytes for any other text), with a chat template. `vllm serve DIR` serves it "
                          "on the CPU.")
    tiny.add_argument("dir", type=Path, help="the folder to write (created)")
    trace_commands.add_commands(sub)
    plan_command.add(sub)
    calibrate_command.add(sub)
    return parser


def _bench(args: argparse.Namespace) -> int:
    """`kvtier bench`: the tiers' figures, or only the vLLM engine's (--vllm) or the shared tier's (--redis)."""
    json_path = str(args.json) if args.json else None
    if args.vllm:
        from kvtier.bench.vllm_engine import run_vllm_bench

        run_vllm_bench(json_path)
    elif args.redis:
        from kvtier.bench.tiers import run_redis

        run_redis(json_path, quick=args.quick)
    else:
        from kvtier.bench.tiers import run

        run(json_path, quick=args.quick, root=str(args.root) if args.root else None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        if args.command in trace_commands.COMMANDS:
            return trace_commands.run(args)
        if args.command == "config":
            return _config(args)
        if args.command in MODULES:
            return MODULES[args.command].run(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "rollout":
            return rollout_command.run(args)
        if args.command == "tiny-model":
            from kvtier.integrations.vllm.tiny_model import build_tiny_llama

            print(build_tiny_llama(args.dir, tokenizer=True))
            return 0
        if args.command == "bench":
            return _bench(args)
    except ConfigError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as exc:  # bad values the config object could not see (e.g. a budget that holds no block)
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.block_size is not None and args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0, got {args.block_size}")
    config = parse_config(args.file) if args.block_size is None else for_engine(args.file, args.block_size)
    if args.block_size is None:
        print("kvtier: block_size and engine_block_size follow vLLM's --block-size when unset (--block-size to "
              "see them)", file=sys.stderr)
    print(json.dumps(config.redacted(), indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.requests <= 0:
        raise ValueError(f"--requests must be > 0, got {args.requests}")
    config = parse_config(args.config) if args.config else None
    if config is not None and not args.in_process:
        raise ValueError("--config applies to --in-process only")
    if not args.in_process:
        return rollout_command.run(args)
    from kvtier.demo.in_process import run_demo

    results = run_demo(n_requests=args.requests, seed=args.seed, config=config)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.as_dict() for r in results], indent=2, default=str))
    return 0 if all(r.exact for r in results) else 1
