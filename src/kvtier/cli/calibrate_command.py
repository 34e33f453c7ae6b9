"""`kvtier calibrate`: its arguments, the embedded server when no --url is given, and the table of the fits.
Bad input, a server that does not answer and a fit that misses its points raise ValueError (exit code 2)."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HELP = "measure the engine you will run and this machine's tiers into a profile (for --profile)"
DESCRIPTION = """\
Measures what the cost model otherwise assumes, and writes it as a profile that `kvtier analyze`, `simulate`,
`plan` and `rollout` read with --profile:

  prefill  the time to the first streamed token of prompts of token ids, of lengths doubling up to one that
           takes about a second (or the server's context), and of the longest with a quarter, a half and three
           quarters of it cached (the cached tokens counted as the server reports them); fitted as
           fixed + per_token * new + per_pair * (new * cached + new * (new + 1) / 2)
  decode   seconds between streamed tokens with 1, 2 and 4 requests decoding at once: base + per_request * batch
  tiers    loads of 1 to 64 blocks from kvtier's host, disk (--disk-root) and Redis (--redis) tiers into an
           engine's pages, and the store path's copy out of them, through kvtier's own stores and mover, in
           this process: latency + bytes / bandwidth. A block is the engine's block size times the model's KV
           bytes per token (--kv-bytes-per-token, or read from the model's config.json)

Each point is the median of --repeats requests (the tiers: of several loads). Each fit must reproduce its own
points within 25% rms, relative to each point: the table shows by how much it does. Without --url it starts the
embedded default, `vllm serve` with a tiny random-weight Llama built here, on this CPU, and stops it after.

  kvtier calibrate --url http://gpu-node:8000 --model /models/llama-3.1-8b --disk-root /mnt/nvme/kv \\
      --redis redis://cache:6379/0 --out profile.json

Exit code 2 when the server does not answer (its URL named), a fit misses its points, or a flag is bad."""
EMBEDDED_START_S = 300.0


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the OpenAI-compatible server to measure, e.g. http://127.0.0.1:8000 (default: "
                   "start the embedded `vllm serve` on this CPU)")
    p.add_argument("--model", help="with --url: the served model's name (default: the first the server lists); "
                   "when it is a folder with a config.json its KV bytes per token are read there. Without --url: a "
                   "folder with a config.json to serve (default: the tiny model, built here)")
    p.add_argument("--out", type=Path, default=Path("profile.json"), help="where to write the profile "
                   "(default profile.json)")
    p.add_argument("--kv-bytes-per-token", type=int, metavar="N", help="the served model's KV bytes per token, "
                   "all layers, K and V (default: derived from --model's config.json; without either the tiers are "
                   "not measured)")
    p.add_argument("--disk-root", type=Path, help="a folder on the disk the disk tier will use (default: the "
                   "system's temp folder); a temp folder is made in it and removed after")
    p.add_argument("--redis", metavar="URL", help="also measure a Redis tier on this server (redis://host:port/db); "
                   "its keys go under a prefix of their own and are deleted after")
    p.add_argument("--repeats", type=int, default=3, help="requests per prefill point, each with fresh tokens; the "
                   "median is kept (default 3)")


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier.calibrate.calibrate import calibrate
    from kvtier.calibrate.server import served_model
    from kvtier.report import readable_console

    _check(args)
    console = readable_console(None, width=120)
    start = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        if args.url is not None:
            url = args.url.rstrip("/")
            model = args.model or served_model(url)
            per_token = args.kv_bytes_per_token or _derived(model)
            profile = calibrate(url, model, per_token, args.disk_root, args.redis, progress, args.repeats)
        else:
            with _embedded(args.model, progress) as (url, model):
                per_token = args.kv_bytes_per_token or _derived(model)
                profile = calibrate(url, model, per_token, args.disk_root, args.redis, progress, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.write(args.out)
    console.print(_table(profile))
    if not profile.tiers:
        console.print("tiers not measured: the model's KV bytes per token are unknown (--kv-bytes-per-token N, or "
                      "--model a folder with its config.json)")
    console.print(f"profile: {args.out} ({time.monotonic() - start:.0f} s)")
    return 0


def _check(args: argparse.Namespace) -> None:
    """Bad flags, before anything starts."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token < 1:
        raise ValueError(f"--kv-bytes-per-token must be >= 1, got {args.kv_bytes_per_token}")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url: expected http://host:port or https://..., got {args.url!r}")
    if args.url is None and args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model: {args.model}: no config.json there (without --url the model is served from a "
                         "folder; write one with `kvtier tiny-model DIR`)")
    if args.redis is not None and not args.redis.startswith(("redis://", "rediss://", "unix://")):
        from kvtier.config import redact_url

        raise ValueError(f"--redis: expected redis://host:port/db, rediss:// or unix://, got {redact_url(args.redis)}")
    if args.disk_root is not None and args.disk_root.exists() and not args.disk_root.is_dir():
        raise ValueError(f"--disk-root: {args.disk_root} is not a folder")
    if args.out.is_dir():
        raise ValueError(f"--out: {args.out} is a folder")


def _derived(model: str) -> int | None:
    """The KV bytes per token of a model folder (or config.json) here; None for a name this machine cannot read."""
    from kvtier.rollout.sizes import bytes_per_token

    path = Path(model)
    if not ((path / "config.json").is_file() or (path.suffix == ".json" and path.is_file())):
        return None
    return bytes_per_token(model)


@contextmanager
def _embedded(model: str | None, progress: Any) -> Iterator[tuple[str, str]]:
    """(url, model) of `vllm serve` started here on the CPU, the rollout's embedded command, stopped after."""
    from kvtier.calibrate import CalibrationError
    from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCKS, build_tiny_llama
    from kvtier.rollout.server import Server, embedded_command, free_port

    with tempfile.TemporaryDirectory(prefix="kvtier-calibrate-") as folder:
        task = progress.add_task("starting vllm serve on this CPU", total=None)
        try:
            served = model or build_tiny_llama(Path(folder) / "tiny-llama", tokenizer=True)
            port = free_port()
            try:
                server = Server(embedded_command(served, None, ENGINE_BLOCKS, port), port,
                                Path(folder) / "server.log", model=served)
            except OSError as exc:
                raise CalibrationError(f"the embedded vllm serve did not start: {exc}") from None
            try:
                server.wait_ready(EMBEDDED_START_S)
            except RuntimeError as exc:
                server.kill()
                raise CalibrationError(f"the embedded vllm serve did not start: {exc}") from None
        finally:
            progress.remove_task(task)
        try:
            yield server.url, served
        finally:
            server.stop()


def _table(profile: Any) -> Any:
    from rich.table import Table

    table = Table(title="kvtier calibrate: the fits, and how closely each reproduces its own measurements",
                  caption="rms: of each point's residual, relative to the point (a fit may miss by 25% at most)")
    table.add_column("fit")
    table.add_column("coefficients")
    table.add_column("points", justify="right")
    table.add_column("rms", justify="right")
    p, d = profile.prefill, profile.decode
    table.add_row("prefill of n new tokens after p cached",
                  f"{p.fixed_s * 1e3:.2f} ms + {p.per_token_s * 1e6:.1f} µs x n + {p.per_pair_s * 1e9:.3f} ns x "
                  "(n·p + n(n+1)/2)", str(len(p.points)), f"{p.relative_rms:.1%}")
    table.add_row("decode, per output token", f"{d.intercept * 1e3:.2f} ms + {d.slope * 1e3:.2f} ms x requests "
                  "decoding", str(len(d.points)), f"{d.relative_rms:.1%}")
    lines = [(f"load from {name} into the engine", fit) for name, fit in profile.tiers.items()]
    lines += [("store, engine -> host", profile.store)] if profile.store is not None else []
    for name, fit in lines:
        table.add_row(name, f"{fit.intercept * 1e6:.0f} µs + bytes / {_rate(fit.bytes_per_s)}", str(len(fit.points)),
                      f"{fit.relative_rms:.1%}")
    return table


def _rate(bytes_per_s: float) -> str:
    return "unbounded" if bytes_per_s == float("inf") else f"{bytes_per_s / 1e9:.2f} GB/s"
