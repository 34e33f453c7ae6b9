"""`kvtier rollout` (and `kvtier demo`, the same on the embedded default): arguments in, a report out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtier.config import finite_float
from kvtier.rollout.harness import STEPS

DESCRIPTION = """\
The seven-step rollout, one change at a time, against a real OpenAI-compatible server over HTTP:
(1) baseline: the engine's prefix cache alone (and, on the embedded default, a reference whose engine cache
holds everything: a bigger GPU, and the exactness oracle); (2) the host's memory headroom; (3) a small host
tier; (4) hit quality: prompt tokens by source from the server's /metrics; (5) tail latency: every step at
rising concurrency, open-loop arrivals, streaming TTFT / ITL / end-to-end p50/p95/p99; (6) a disk tier and its
drills: promotion burst, storage pressure, kill -9 restart, cache loss; (7) the rollback rule: the guard's
TTFT budget (1.5 x the baseline's worst p99 unless given) on every level and drill, the guard running in the
server, and a drill that slows the disk past the budget until the guard turns it off and back on (one request
at a time: its budget is 1.5 x the baseline's p99 at concurrency 1 unless given).

By default it starts `vllm serve` itself for each step: a tiny random-weight Llama built here, on this CPU.
--command starts your server instead: a shell template with {port} and {kv_transfer_config}, e.g.
  kvtier rollout --steps baseline,host --command 'vllm serve my/model --port {port} {kv_transfer_config}'
Exit code 1 when a request served from a tier differs from the reference or a drill fails."""


def add(sub: argparse._SubParsersAction) -> None:
    rollout = sub.add_parser("rollout", help="the seven-step rollout against a real server over HTTP",
                             description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    rollout.add_argument("--trace", type=Path, help="a trace instead of the built-in mix: kvtier JSONL, Mooncake, "
                         "or kv-cache-tester agentic (a .json, a folder of them, JSONL); blocks become token ids")
    rollout.add_argument("--command", dest="server_command",
                         help="a shell template that starts your server (see above)")
    rollout.add_argument("--steps", default=",".join(STEPS),
                         help=f"comma-separated, in order (default: {','.join(STEPS)})")
    rollout.add_argument("--levels", default="1,2,4", help="concurrency levels (default 1,2,4); 1 is one request at "
                         "a time, the others open-loop Poisson arrivals at that many times level 1's service rate")
    rollout.add_argument("--ttft-budget-ms", type=finite_float, help="the rollback rule's TTFT p99 budget")
    rollout.add_argument("--model", type=Path, help="the embedded server's model: a folder `kvtier tiny-model` "
                         "wrote (default: one built here)")
    common(rollout, requests=24)


def common(parser: argparse.ArgumentParser, requests: int) -> None:
    parser.add_argument("--requests", type=int, default=requests, help=f"requests per level (default {requests})")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request at most (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--html", type=Path, help="write the plots and tables to this HTML file")


def run(args: argparse.Namespace) -> int:
    from kvtier.report import readable_console
    from kvtier.rollout.harness import Options
    from kvtier.rollout.present import tables, write_html
    from kvtier.rollout.run import run as run_rollout

    try:
        levels = tuple(sorted({int(v) for v in getattr(args, "levels", "1,2,4").split(",")} | {1}))
    except ValueError:
        raise ValueError(f"--levels: expected comma-separated ints, got {args.levels!r}") from None
    trace = getattr(args, "trace", None)
    if trace is not None and not trace.exists():
        raise ValueError(f"--trace: {trace}: no such file or folder")
    model = getattr(args, "model", None)
    if model is not None and not (model / "config.json").is_file():
        raise ValueError(f"--model: {model}: no config.json there (write one with `kvtier tiny-model DIR`)")
    opts = Options(requests=args.requests, levels=levels, max_tokens=args.max_tokens, trace=trace, model=model,
                   command=getattr(args, "server_command", None), seed=args.seed,
                   steps=tuple(s.strip() for s in getattr(args, "steps", ",".join(STEPS)).split(",") if s.strip()),
                   ttft_budget_ms=getattr(args, "ttft_budget_ms", None))
    console = readable_console(None, width=170)
    report = run_rollout(opts, console)
    for renderable in tables(report):
        console.print(renderable)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.html:
        write_html(report, args.html)
        console.print(f"plots: {args.html}")
    failed = [d["drill"] for s in report["steps"] for d in s.get("drills", []) if not d["passed"]]
    return 1 if report.get("exact") is False or failed else 0
