"""Configurations replay in processes of their own, one per core.

Each configuration's replay is independent, pure Python and CPU-bound: threads would queue on the GIL. The
children are forked, so they inherit the parsed trace instead of unpickling it; only a configuration goes in
and its result comes back. Progress crosses as a shared counter the parent polls.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from typing import Any, TypeVar

C = TypeVar("C")
R = TypeVar("R")
Tick = Callable[[], None]
_TICKS_PER_UPDATE = 500  # requests a child replays between two updates of the shared counter
_POLL_S = 0.2

_replay: Callable[[Any, Tick | None], Any] | None = None  # set in the parent just before the fork
_replayed: Any = None  # the shared count of replayed requests, over all children


def map_configs(replay: Callable[[C, Tick | None], R], configs: Sequence[C], on_request: Tick | None = None,
                workers: int | None = None, weight: Callable[[C], float] | None = None) -> list[R]:
    """`[replay(c, tick) for c in configs]`, in up to `workers` processes (default: one per core); `on_request`
    is called once per replayed request of any configuration, in this process. `weight`: how long a
    configuration takes, roughly; the heaviest start first, so that no process is left with the last two."""
    workers = min(len(configs), workers or os.cpu_count() or 1)
    if workers <= 1 or "fork" not in mp.get_all_start_methods():
        return [replay(config, on_request) for config in configs]
    global _replay, _replayed
    context = mp.get_context("fork")
    _replay, _replayed = replay, context.Value("q", 0)
    try:
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            heaviest = sorted(range(len(configs)), key=lambda i: -weight(configs[i])) if weight else range(len(configs))
            submitted = {i: pool.submit(_child, configs[i]) for i in heaviest}
            futures = [submitted[i] for i in range(len(configs))]
            seen = 0
            while True:
                done, _ = wait(futures, timeout=_POLL_S)
                now = _replayed.value
                if on_request is not None:
                    for _ in range(now - seen):
                        on_request()
                seen = now
                if len(done) == len(futures):
                    return [future.result() for future in futures]
    finally:
        _replay = _replayed = None


def _child(config: Any) -> Any:
    assert _replay is not None
    pending = [0]

    def publish() -> None:
        with _replayed.get_lock():
            _replayed.value += pending[0]
        pending[0] = 0

    def tick() -> None:
        pending[0] += 1
        if pending[0] >= _TICKS_PER_UPDATE:
            publish()

    result = _replay(config, tick)
    publish()
    return result
