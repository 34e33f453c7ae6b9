"""`kvtier rollout` (and `kvtier demo`, the same on the embedded default): arguments in, a report out."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from kvtier.config import finite_float
from kvtier.rollout.options import STEPS

DESCRIPTION = """\
The seven-step rollout, one change at a time, against a real OpenAI-compatible server over HTTP:
(1) baseline: the engine's prefix cache alone (and, on the embedded default, a reference whose engine cache
holds everything: a bigger GPU, and the exactness oracle); (2) the host's memory headroom, and the tiers sized
by it and by the workload (the host tier at the elbow of its reuse curve, the disk tier for the rest it
reuses); (3) a host tier; (4) hit quality: prompt tokens by source from the server's /metrics; (5) tail
latency at rising load: closed-loop clients (each sends its next request once answered, after a think time),
TTFT / ITL / end-to-end p50/p95/p99 with the count each rests on, how busy the server was and how long requests
queued; (6) a disk tier and its drills: promotion burst, storage pressure, kill -9 restart, cache loss; (7) the
rollback rule: the guard's TTFT budget (1.5 x the baseline's worst p99 over the levels it carried, unless
given) on every level and drill, the guard running in the server, and a drill that slows the disk past the
budget until the guard turns it off and back on.

By default it starts `vllm serve` itself for each step: a tiny random-weight Llama built here, on this CPU.
--command starts your server instead: a shell template with {port} and {kv_transfer_config}, e.g.
  kvtier rollout --steps baseline,host --model my/config.json --disk-root /mnt/nvme/kv \\
      --command 'vllm serve my/model --port {port} {kv_transfer_config}'
Exit code 1 when a request served from a tier differs from the reference or a drill fails; 2 on bad input."""

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12}


def add(sub: argparse._SubParsersAction) -> None:
    rollout = sub.add_parser("rollout", help="the seven-step rollout against a real server over HTTP",
                             description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    rollout.add_argument("--trace", type=Path, help="a trace instead of the built-in mix: kvtier JSONL, Mooncake, "
                         "or kv-cache-tester agentic (a .json, a folder of them, JSONL); blocks become token ids")
    rollout.add_argument("--command", dest="server_command",
                         help="a shell template that starts your server (see above)")
    rollout.add_argument("--steps", default=",".join(STEPS),
                         help=f"comma-separated, in order (default: {','.join(STEPS)})")
    rollout.add_argument("--ttft-budget-ms", type=finite_float, help="the rollback rule's TTFT p99 budget")
    rollout.add_argument("--host-bytes", help="the host tier (e.g. 64MiB, 2GiB; default: at the elbow of the "
                         "workload's reuse curve, within the host's headroom)")
    rollout.add_argument("--disk-bytes", help="the disk tier (default: the rest of what the workload reuses)")
    rollout.add_argument("--disk-root", type=Path, help="where the disk tier's files go: your NVMe (default: a temp "
                         "folder of the rollout's)")
    rollout.add_argument("--kv-config", type=Path, help="a JSON object of step name (host, host+disk, rollback) -> "
                         "that step's whole kv_connector_extra_config, in place of the sized tiers")
    common(rollout, requests=40)


def common(parser: argparse.ArgumentParser, requests: int) -> None:
    parser.add_argument("--model", help="the served model: a folder with its config.json (the embedded server "
                        "serves it; default: a tiny model built here), or with --command its config.json or a "
                        "preset (`kvtier plan --help`): the tiers are sized in its KV bytes")
    parser.add_argument("--levels", default="1,2", help="closed-loop clients per level (default 1,2); 1 is one "
                        "request at a time, what the exactness check compares")
    parser.add_argument("--think-s", type=finite_float, help="each client's mean think time between its requests "
                        "(default: from the server's measured service time, so that the busiest level would keep "
                        "it busy 90%% of the time were every prompt recomputed; 0: back to back, as vllm bench "
                        "serve --max-concurrency)")
    parser.add_argument("--rates", help="open loop instead of --levels: Poisson arrivals at these fractions of the "
                        "server's measured capacity (e.g. 0.3,0.6)")
    parser.add_argument("--requests", type=int, default=requests, help=f"requests per level (default {requests})")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request at most (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--profile", type=Path, help="the predictions' costs from this profile (`kvtier calibrate`) "
                        "instead of measuring them on the first server")
    parser.add_argument("--no-predict", action="store_true", help="send the levels without predicting them first "
                        "(no calibration: about a minute less)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--html", type=Path, help="write the plots and tables to this HTML file")


def byte_size(flag: str, text: str | None) -> int | None:
    """`--host-bytes 64MiB`: an int of bytes, with an optional unit (KiB, MiB, GiB, TiB or KB, MB, GB, TB)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in UNITS:
        raise ValueError(f"{flag}: expected a number of bytes with an optional unit (e.g. 64MiB), got {text!r}")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{flag}: a number of bytes >= 1, got {text!r}")
    return int(value)


def _numbers(flag: str, text: str | None, kind: type) -> tuple:
    if not text:
        return ()
    try:
        return tuple(kind(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated {kind.__name__}s, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from kvtier.report import readable_console
    from kvtier.rollout.options import Options
    from kvtier.rollout.present import tables, write_html
    from kvtier.rollout.run import run as run_rollout

    levels = tuple(sorted(set(_numbers("--levels", args.levels, int)) | {1}))
    trace = getattr(args, "trace", None)
    if trace is not None and not trace.exists():
        raise ValueError(f"--trace: {trace}: no such file or folder")
    command = getattr(args, "server_command", None)
    if args.model is not None and not command and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model: {args.model}: no config.json there (write one with `kvtier tiny-model DIR`)")
    opts = Options(requests=args.requests, levels=levels, think_s=args.think_s,
                   rates=_numbers("--rates", args.rates, float), max_tokens=args.max_tokens, trace=trace,
                   model=args.model, command=command, seed=args.seed,
                   steps=tuple(s.strip() for s in getattr(args, "steps", ",".join(STEPS)).split(",") if s.strip()),
                   ttft_budget_ms=getattr(args, "ttft_budget_ms", None),
                   host_bytes=byte_size("--host-bytes", getattr(args, "host_bytes", None)),
                   disk_bytes=byte_size("--disk-bytes", getattr(args, "disk_bytes", None)),
                   disk_root=getattr(args, "disk_root", None), kv_config=getattr(args, "kv_config", None),
                   predict=not args.no_predict, profile=args.profile)
    opts.check()
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
