"""A profile of one engine on one machine: the server's prefill and decode, measured over HTTP, and kvtier's tiers,
measured in this process, each fitted to the cost model's form and checked to reproduce its own points.

The longest prompt is found by doubling one until its prefill takes a second (or the server's context is full):
long enough for the quadratic term to show, short enough that a calibration takes a minute or so on any engine.
The tiers' loads are fast and noisy on a shared machine: a tier whose fit misses its points is measured again, a
few times at most, and the best fit kept; a fit that still misses is a ProfileError, as a prefill's is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.calibrate.server import (
    longest_prompt,
    measure_decode,
    measure_prefill,
    prefill_plan,
    server_identity,
)
from kvtier.calibrate.tiers import load_sizes, measure_tiers
from kvtier.sim.profile import (
    MAX_RELATIVE_RMS,
    LineFit,
    PrefillFit,
    Profile,
    checked,
    fit_line,
    fit_prefill_curve,
    machine_identity,
)

FALLBACK_BLOCK_SIZE = 16  # vLLM's default on GPUs, where the server does not say its block size
FALLBACK_MAX_MODEL_LEN = 4096
MAX_PROMPT = 32768  # the longest prompt a calibration sends, whatever the server's context
PREFILL_BUDGET_S = 1.0  # the longest prompt's prefill takes about this long (`longest_prompt`)
DECODE_BATCHES = (1, 2, 4)
ATTEMPTS = 3  # measurements of the tiers (and of decode) at most, where a fit misses its points


def calibrate(url: str, model: str, kv_bytes_per_token: int | None, disk_root: Path | None = None,
              redis_url: str | None = None, progress: Any = None, repeats: int = 3) -> Profile:
    """The profile of the server at `url` serving `model`, and of this machine's tiers when the served model's KV
    bytes per token are known (a block is then the engine's block size times them). `progress`: a rich Progress
    to show each phase in (its tasks are removed when done). ProfileError when a fit misses its points,
    CalibrationError when the server does not answer or cannot be measured."""
    if kv_bytes_per_token is not None and kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    url = url.rstrip("/")
    with _task(progress, "calibrate: the server", None):
        server = server_identity(url, model)
        block_size = server["block_size"] or FALLBACK_BLOCK_SIZE
        limit = min(MAX_PROMPT, (server["max_model_len"] or FALLBACK_MAX_MODEL_LEN) - 1)
        longest = longest_prompt(url, model, limit, PREFILL_BUDGET_S)
    with _task(progress, f"calibrate: prefill up to {longest} tokens", len(prefill_plan(block_size, longest))) as step:
        points = measure_prefill(url, model, block_size, longest, repeats, on_point=lambda _: step())
    prefill = checked(fit_prefill_curve(points), "prefill")
    assert isinstance(prefill, PrefillFit)

    def decode_points(step: Callable[[], None]) -> dict[str, list[tuple[float, float]]]:
        return {"decode": measure_decode(url, model, DECODE_BATCHES, on_point=lambda _: step())}

    decode = _best_fits(decode_points, {"decode": "decode"}, len(DECODE_BATCHES), "decode", progress)["decode"]
    tiers: dict[str, LineFit] = {}
    store = None
    block_bytes = None
    if kv_bytes_per_token is not None:
        block_bytes = block_size * kv_bytes_per_token
        names = {"host": "load from host", "disk": "load from disk", "store": "store"}
        if redis_url is not None:
            names["redis"] = "load from redis"

        def tier_points(step: Callable[[], None]) -> dict[str, list[tuple[float, float]]]:
            return measure_tiers(block_bytes, disk_root, redis_url, on_point=lambda *_: step())

        fits = _best_fits(tier_points, names, len(names) * len(load_sizes(block_bytes)),
                          f"tiers: loads of {block_bytes} B blocks", progress)
        store = fits.pop("store")
        tiers = fits
    server |= {"kv_bytes_per_token": kv_bytes_per_token, "block_bytes": block_bytes, "longest_prompt": longest,
               "repeats": repeats}
    return Profile(machine_identity(), server, prefill, decode, tiers, store)


def _best_fits(measure: Callable[[Callable[[], None]], dict[str, list[tuple[float, float]]]], names: dict[str, str],
               points: int, what: str, progress: Any) -> dict[str, LineFit]:
    """Line fits of what `measure` returns (key -> points; `names`: how each is called), measured again while a
    fit misses its points, ATTEMPTS times at most; each key's best fit, checked."""
    best: dict[str, LineFit] = {}
    for attempt in range(ATTEMPTS):
        again = [names[k] for k, fit in best.items() if fit.relative_rms > MAX_RELATIVE_RMS]
        label = f"calibrate: {what}" + (f" (again: {', '.join(again)})" if attempt else "")
        with _task(progress, label, points) as step:
            measured = measure(step)
        for key, found in measured.items():
            fit = fit_line(found, names[key])
            if key not in best or fit.relative_rms < best[key].relative_rms:
                best[key] = fit
        if all(fit.relative_rms <= MAX_RELATIVE_RMS for fit in best.values()):
            break
    out = {}
    for key, fit in best.items():
        line = checked(fit, names[key])
        assert isinstance(line, LineFit)
        out[key] = line
    return out


@contextmanager
def _task(progress: Any, description: str, total: int | None) -> Iterator[Callable[[], None]]:
    """A task of `progress` (none: nothing shown) for the block, and the call that advances it; removed after."""
    if progress is None:
        yield lambda: None
        return
    task = progress.add_task(description, total=total)
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.remove_task(task)
