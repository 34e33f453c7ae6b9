"""The rollout's client: streaming `/v1/completions` requests, open-loop, as production traffic arrives.

Arrivals are a Poisson process at a set rate, independent of how fast the server answers (open loop: a slow
server faces a growing queue, as it would in production), or one at a time (closed loop, concurrency 1: every
request computed alone, which the exactness check needs). Prompts are token ids, so any trace's blocks can be
sent to any model. TTFT is the first streamed token, ITL the gaps between the next ones, both as the client
sees them; the cached prompt tokens come from the server's usage report.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    tokens: list[int]
    kind: str  # what the workload made it: system, rag, session, unique, or a trace's session kind
    max_tokens: int


@dataclass
class Result:
    kind: str
    prompt_tokens: int = 0
    cached: int = 0  # usage.prompt_tokens_details.cached_tokens: the engine's and the connector's hits
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict:
        fields = ("kind", "prompt_tokens", "cached", "ttft", "e2e", "tokens", "logprobs", "error")
        return {k: getattr(self, k) for k in fields} | {"itl_mean": sum(self.itl) / len(self.itl) if self.itl else 0.0}


def send(url: str, model: str, prompts: Sequence[Prompt], rate: float | None, seed: int = 0,
         on_done: Callable[[], None] | None = None, timeout_s: float = 600) -> list[Result]:
    """Send `prompts`: at Poisson arrivals of `rate` per second, or one at a time when `rate` is None."""
    return asyncio.run(_send(url, model, prompts, rate, seed, on_done, timeout_s))


async def _send(url: str, model: str, prompts: Sequence[Prompt], rate: float | None, seed: int,
                on_done: Callable[[], None] | None, timeout_s: float) -> list[Result]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(prompt: Prompt) -> Result:
            result = await _request(session, url, model, prompt)
            if on_done:
                on_done()
            return result

        if rate is None:
            return [await one(p) for p in prompts]
        rng = random.Random(seed)
        start, at, tasks = time.monotonic(), 0.0, []
        for prompt in prompts:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(prompt)))
            at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


async def _request(session: Any, url: str, model: str, prompt: Prompt) -> Result:
    import aiohttp

    body = {"model": model, "prompt": prompt.tokens, "max_tokens": prompt.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    result = Result(kind=prompt.kind, prompt_tokens=len(prompt.tokens))
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    logprobs = choice.get("logprobs") or {}
                    result.tokens += logprobs.get("tokens", [])
                    result.logprobs += logprobs.get("token_logprobs", [])
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    result.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    return result
