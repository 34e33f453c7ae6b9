"""What the served engine costs, measured over HTTP as its clients see it: prefill (time to the first streamed
token of a prompt of token ids, with and without a cached prefix) and decode (seconds per output token with several
requests decoding at once).

Every prompt is fresh random token ids, salted per call, so that nothing is cached unless a point asks for it,
not even by an earlier calibration against the same server. A cached point first sends its prefix, then the
prefix and its new tokens; the cached count recorded is the one the server reports
(`usage.prompt_tokens_details.cached_tokens`), not the one intended. Each point is the median of its repeats.
"""

from __future__ import annotations

import json
import math
import random
import secrets
import statistics
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvtier.calibrate import CalibrationError

TOKEN_IDS = (3, 32000)  # prompts are drawn from these ids: past the usual special tokens, inside a Llama vocabulary
SMALLEST_PROMPT = 64
PREFILL_SIZES = 6  # new-token sizes, geometric from SMALLEST_PROMPT to the longest prompt
CACHED_SHARES = (0.25, 0.5, 0.75)  # cached points: this share of the longest prompt cached, the rest new
REQUEST_TIMEOUT_S = 300.0
DECODE_PROMPT = 16  # tokens of each decode request's prompt: its prefill barely shows in the gaps
TPOT = "vllm:request_time_per_output_token_seconds"  # vLLM's TPOT of each finished request, engine-side timestamps
TPOT_WAIT_S = 3.0  # how long a batch's requests may take to reach /metrics after their responses ended


def server_identity(url: str, model: str) -> dict:
    """{"url", "model", "max_model_len", "block_size", "vllm_version"}: what the profile says it was measured on.
    The block size is vLLM's (`vllm:cache_config_info` on /metrics), None where the server does not say."""
    url = url.rstrip("/")
    models = _json(url, "/v1/models").get("data") or []
    entry = next((m for m in models if isinstance(m, dict) and m.get("id") == model), None)
    if entry is None:
        served = ", ".join(repr(m.get("id")) for m in models if isinstance(m, dict)) or "nothing"
        raise CalibrationError(f"{url} does not serve the model {model!r} (it serves {served})")
    try:
        version = _json(url, "/version").get("version")
    except CalibrationError:
        version = None
    return {"url": url, "model": model, "max_model_len": entry.get("max_model_len"),
            "block_size": _block_size(url), "vllm_version": version}


def served_model(url: str) -> str:
    """The first model the server lists on /v1/models (what a single-model `vllm serve` serves)."""
    url = url.rstrip("/")
    models = _json(url, "/v1/models").get("data") or []
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise CalibrationError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def longest_prompt(url: str, model: str, limit: int, budget_s: float = 1.0, seed: int = 0) -> int:
    """The longest prompt the prefill points go up to: doubled from SMALLEST_PROMPT until one takes `budget_s`
    or more (the quadratic term then shows, and a calibration stays short on any engine), at most `limit`."""
    if limit < 1:
        raise CalibrationError(f"{url}: no room for a prompt (longest allowed {limit})")
    tokens = _Tokens(seed)
    _warm_up(url, model, tokens)
    n = min(SMALLEST_PROMPT, limit)
    while n < limit and _first_token(url, model, tokens.fresh(n))[0] < budget_s:
        n = min(2 * n, limit)
    return n


def prefill_plan(block_size: int, max_prompt: int) -> list[tuple[int, int]]:
    """(new tokens, cached tokens intended) of each prefill point: new-token sizes geometric up to `max_prompt`,
    none cached; then prompts of `max_prompt` tokens with a quarter, a half, three quarters of them cached
    (whole blocks), which cost less than the longest uncached point where the cache works."""
    low = min(SMALLEST_PROMPT, max(1, max_prompt // 8))
    ratio = (max_prompt / low) ** (1 / (PREFILL_SIZES - 1)) if max_prompt > low else 1.0
    sizes = sorted({min(max_prompt, round(low * ratio**i)) for i in range(PREFILL_SIZES)})
    points = [(n, 0) for n in sizes]
    for share in CACHED_SHARES:
        cached = int(max_prompt * share) // block_size * block_size
        if 0 < cached < max_prompt and (max_prompt - cached, cached) not in points:
            points.append((max_prompt - cached, cached))
    return points


def measure_prefill(url: str, model: str, block_size: int, max_prompt: int, repeats: int = 3,
                    on_point: Callable[[tuple[int, int, float]], None] | None = None,
                    seed: int = 0) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens, seconds) of each point of `prefill_plan`: the time to the first streamed token
    of `max_tokens=1` completions, the median of `repeats`, each with fresh tokens. The counts are what the
    server reports: a point whose repeats it counted differently keeps the repeats of the count most reported."""
    url = url.rstrip("/")
    if block_size < 1 or max_prompt < 1 or repeats < 1:
        raise ValueError(f"measure_prefill: block_size, max_prompt and repeats must be >= 1, got {block_size}, "
                         f"{max_prompt}, {repeats}")
    tokens = _Tokens(seed)
    _warm_up(url, model, tokens)
    points = []
    for new, cached in prefill_plan(block_size, max_prompt):
        runs: list[tuple[int, int, float]] = []
        for _ in range(repeats):
            prefix = tokens.fresh(cached)
            if cached:
                _first_token(url, model, prefix)  # now in the engine's prefix cache
            seconds, prompt_tokens, reported = _first_token(url, model, prefix + tokens.fresh(new))
            if reported is None:
                if cached:
                    raise CalibrationError(f"{url} does not report cached prompt tokens "
                                           "(usage.prompt_tokens_details): start vLLM with "
                                           "--enable-prompt-tokens-details")
                reported = 0
            runs.append((prompt_tokens - reported, reported, seconds))
        counts = Counter((n, c) for n, c, _ in runs).most_common(1)[0][0]
        point = (*counts, statistics.median(s for n, c, s in runs if (n, c) == counts))
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


def measure_decode(url: str, model: str, batches: Sequence[int] = (1, 2, 4), tokens: int = 32,
                   on_point: Callable[[tuple[float, float]], None] | None = None) -> list[tuple[float, float]]:
    """(batch, seconds per output token) with `batch` requests streaming `tokens` tokens each (ignore_eos) at once:
    vLLM's TPOT (a request's span from its first token to its last over the tokens after the first), the mean over
    the batch as the engine timed it (`TPOT` on /metrics). Where /metrics has no such histogram, or other requests
    finished meanwhile, the median over the batch of the same span as the client saw the stream. The engine's own
    timestamps come first: on a busy machine the API server reads the engine's outputs late, and the stream then
    arrives in bursts whose spans say little of the step (a request's tokens all in one burst: a span of
    microseconds)."""
    from kvtier.rollout.client import Load, Prompt, send

    url = url.rstrip("/")
    if tokens < 2 or not batches or any(b < 1 for b in batches):
        raise ValueError(f"measure_decode: tokens >= 2 and batches >= 1, got {tokens} and {tuple(batches)}")
    ids = _Tokens(0)
    _warm_up(url, model, ids)
    points = []
    for batch in batches:
        prompts = [Prompt(ids.fresh(DECODE_PROMPT), "decode", tokens) for _ in range(batch)]
        before = _tpot_totals(url)
        results = send(url, model, prompts, Load(clients=batch), timeout_s=REQUEST_TIMEOUT_S)
        failed = next((r.error for r in results if r.error), None)
        if failed is not None:
            raise CalibrationError(f"{url}/v1/completions: {failed}")
        engine = _engine_tpot(url, before, batch)
        if engine is None:
            per_token = [sum(r.itl) / (len(r.tokens) - 1) for r in results if r.itl and len(r.tokens) > 1]
            if len(per_token) < len(results):
                raise CalibrationError(f"{url}: streamed no second token of {tokens} (is the stream buffered?)")
            engine = statistics.median(per_token)
        point = (float(batch), engine)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


# ------------------------------------------------------------------------------------------------ HTTP


class _Tokens:
    """Fresh random token ids: a generator seeded by `seed` and a salt of this call's own."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(f"{seed}/{secrets.token_hex(8)}")

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_IDS) for _ in range(n)]


def _warm_up(url: str, model: str, tokens: _Tokens) -> None:
    """A fresh server's first request pays for what it sets up (seconds on vLLM's CPU backend): not a point."""
    for _ in range(2):
        _first_token(url, model, tokens.fresh(SMALLEST_PROMPT))


def _first_token(url: str, model: str, prompt: list[int]) -> tuple[float, int, int | None]:
    """(seconds to the first streamed token, prompt tokens, cached prompt tokens or None where the server does
    not report them) of a streamed completion of one token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    first, usage = math.nan, None
    start = time.perf_counter()
    with _opened(url, request) as response:
        try:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if math.isnan(first) and chunk.get("choices"):
                    first = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        except (OSError, ValueError) as exc:  # the stream broke off, or is not what vLLM streams
            raise CalibrationError(f"{url}/v1/completions: {type(exc).__name__}: {exc}") from None
    if math.isnan(first) or not isinstance(usage, dict):
        raise CalibrationError(f"{url}/v1/completions streamed no token or no usage for a prompt of {len(prompt)} "
                               "tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return first, int(usage.get("prompt_tokens", len(prompt))), None if cached is None else int(cached)


def _json(url: str, path: str) -> dict:
    with _opened(url, f"{url}{path}", timeout=30) as response:
        try:
            data = json.loads(response.read())
        except ValueError:
            raise CalibrationError(f"{url}{path}: not JSON") from None
    return data if isinstance(data, dict) else {}


def _block_size(url: str) -> int | None:
    sizes = [s.labels.get("block_size", "") for s in _samples(url) or () if s.name == "vllm:cache_config_info"]
    return int(sizes[0]) if sizes and sizes[0].isdigit() else None


def _tpot_totals(url: str) -> tuple[float, float] | None:
    """vLLM's `TPOT` histogram, its sum and count over every engine; None where /metrics has none."""
    samples = _samples(url) or []
    sums = [s.value for s in samples if s.name == f"{TPOT}_sum"]
    counts = [s.value for s in samples if s.name == f"{TPOT}_count"]
    return (sum(sums), sum(counts)) if counts else None


def _engine_tpot(url: str, before: tuple[float, float] | None, requests: int) -> float | None:
    """The mean TPOT of the `requests` that finished since `before` (`_tpot_totals`), once all of them reached
    /metrics; None where the server has no such histogram, other requests finished too, or they never arrived."""
    if before is None:
        return None
    deadline = time.monotonic() + TPOT_WAIT_S
    while True:
        after = _tpot_totals(url)
        if after is None:
            return None
        seconds, count = after[0] - before[0], after[1] - before[1]
        if count == requests and seconds > 0:
            return seconds / count
        if count > requests or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _samples(url: str) -> list[Sample] | None:
    """Every sample on the server's /metrics; None where it has none, or not in Prometheus' text format (the
    client's own figures then stand in)."""
    try:
        with _opened(url, f"{url}/metrics", timeout=30) as response:
            text = response.read().decode(errors="replace")
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except (CalibrationError, ValueError):
        return None


def _opened(url: str, request: urllib.request.Request | str, timeout: float = REQUEST_TIMEOUT_S) -> Any:
    """urlopen, its failures as CalibrationError naming the server: one that does not answer, or answers an
    error (with the start of its body)."""
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        where = request if isinstance(request, str) else request.full_url
        body = exc.read().decode(errors="replace")[:300]
        raise CalibrationError(f"{where}: HTTP {exc.code}: {body}") from None
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, not a URL
        reason = getattr(exc, "reason", None) or exc
        raise CalibrationError(f"{url}: the server does not answer ({reason})") from None
