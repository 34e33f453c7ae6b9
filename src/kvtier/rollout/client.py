"""The rollout's client: streaming `/v1/completions` requests, as users and production traffic send them.

Two loads. Closed loop (the default, what `vllm bench serve --max-concurrency` and the method's "raise the
concurrency" mean): N clients, each sending its next prompt once its last one is answered and it has thought
for an exponential time of mean `think_s`; the server never holds more than N requests, whatever its speed.
Open loop: Poisson arrivals at a set rate, independent of how fast the server answers (a slow server faces a
growing queue). Prompts are token ids, so any trace's blocks can be sent to any model. TTFT is the first
streamed token, ITL the gaps between the next ones, both as the client sees them; the cached prompt tokens come
from the server's usage report; each request's send and end times give the load's busy share.
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
    reused: bool = False  # it starts with tokens an earlier prompt of its workload started with (workload.py)


@dataclass(frozen=True)
class Load:
    """How prompts are sent: `clients` closed-loop clients thinking `think_s` on average between requests, or,
    with `rate`, open-loop Poisson arrivals at that many requests per second."""

    clients: int = 1
    think_s: float = 0.0
    rate: float | None = None

    @property
    def closed(self) -> bool:
        return self.rate is None


ONE_AT_A_TIME = Load()


@dataclass
class Result:
    kind: str
    reused: bool = False
    prompt_tokens: int = 0
    cached: int = 0  # usage.prompt_tokens_details.cached_tokens: the engine's and the connector's hits
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    sent_at: float = 0.0  # seconds from the start of the load
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict:
        fields = ("kind", "reused", "prompt_tokens", "cached", "ttft", "e2e", "sent_at", "tokens", "logprobs", "error")
        return {k: getattr(self, k) for k in fields} | {"itl_mean": sum(self.itl) / len(self.itl) if self.itl else 0.0}


def send(url: str, model: str, prompts: Sequence[Prompt], load: Load = ONE_AT_A_TIME, seed: int = 0,
         on_done: Callable[[], None] | None = None, timeout_s: float = 600) -> list[Result]:
    """Send `prompts` (in order, as clients free up, or at Poisson arrivals); the results in the same order."""
    return asyncio.run(_send(url, model, prompts, load, seed, on_done, timeout_s))


def busy_share(results: Sequence[Result]) -> float:
    """The share of the load's time with at least one request in flight: the server had work (an upper bound of
    its engine's busy share, which excludes the HTTP and queue time around each request)."""
    spans = sorted((r.sent_at, r.sent_at + r.e2e) for r in results)
    if not spans:
        return 0.0
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    first, last = spans[0][0], max(e for _, e in spans)
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy / (last - first) if last > first else 1.0


async def _send(url: str, model: str, prompts: Sequence[Prompt], load: Load, seed: int,
                on_done: Callable[[], None] | None, timeout_s: float) -> list[Result]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    results: list[Result | None] = [None] * len(prompts)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> None:
            result = await _request(session, url, model, prompts[i], start)
            results[i] = result
            if on_done:
                on_done()

        if load.rate is not None:
            rng, at, tasks = random.Random(seed), 0.0, []
            for i in range(len(prompts)):
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                tasks.append(asyncio.create_task(one(i)))
                at += rng.expovariate(load.rate)
            await asyncio.gather(*tasks)
        else:
            queue = iter(range(len(prompts)))  # the clients take the next prompt in order as each frees up

            async def client(c: int) -> None:
                think = random.Random(f"{seed}/client/{c}")
                for i in queue:
                    await one(i)
                    if load.think_s > 0:
                        await asyncio.sleep(think.expovariate(1 / load.think_s))

            await asyncio.gather(*(client(c) for c in range(load.clients)))
    return [r for r in results if r is not None]


async def _request(session: Any, url: str, model: str, prompt: Prompt, epoch: float) -> Result:
    import aiohttp

    body = {"model": model, "prompt": prompt.tokens, "max_tokens": prompt.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    result = Result(prompt.kind, prompt.reused, prompt_tokens=len(prompt.tokens), sent_at=time.monotonic() - epoch)
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
