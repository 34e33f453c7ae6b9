"""The guard and the load-or-recompute decision, wired into a directory: the one place every driver (the
in-process cache, the vLLM connector's scheduler half, the simulator) gets them from.

The guard's verdicts reach the directory here and nowhere else: whenever the guard's clock moves (a request
routed, a latency observed, a tick), the tiers it turned off stop taking writes (`Directory.disabled`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvtier.config import GuardConfig, KVTierConfig
from kvtier.decide import Decider
from kvtier.directory import Directory
from kvtier.guard import KEEP_TRANSITIONS, Guard, request_source


class Control:
    def __init__(self, directory: Directory, config: KVTierConfig, block_bytes: int, start: float,
                 guard: GuardConfig | None = None, keep: int | None = KEEP_TRANSITIONS) -> None:
        """`guard`: in place of the config's (the simulator's override); `keep`: the guard's transitions kept."""
        self.directory = directory
        self.tiers = directory.names
        guard_config = guard or config.guard
        self.guard = Guard(guard_config, self.tiers, start=start, keep=keep) if guard_config is not None else None
        self.decider = Decider(config.load_policy, config.max_load_tokens, config.prefill_tokens_per_s, block_bytes)

    def route(self, now: float) -> frozenset[str]:
        """The tiers one new request must not read: those the guard turned off, and those on probe unless this
        request is a probe's share."""
        if self.guard is None:
            return frozenset()
        skip = self.guard.route(now)
        self._apply()
        return skip

    def off(self) -> frozenset[str]:
        """The tiers off or on probe, as of the guard's last tick: for a read that is no request's (it is never
        a probe's)."""
        return self.guard.off() if self.guard is not None else frozenset()

    def observe(self, source: str, now: float, ttft_s: float | None = None, itl_s: Sequence[float] = (),
                served_s: float | None = None) -> None:
        """One request's latency, attributed to `source` (`source_of`); `served_s`: the part of its TTFT after the
        engine took it up, where the driver knows it."""
        if self.guard is not None:
            self.guard.observe(source, now, ttft_s=ttft_s, itl_s=itl_s, served_s=served_s)
            self._apply()

    def tick(self, now: float) -> None:
        if self.guard is not None:
            self.guard.tick(now)
            self._apply()

    def source_of(self, served: Iterable[str], engine_hit: bool, seconds: Mapping[str, float] | None = None) -> str:
        """Where a request's prefix came from, for the guard: the tier whose part of its load took longest
        (`seconds`, as measured; else the slowest by configuration), the engine's cache, or recompute."""
        return request_source(served, self.tiers, engine_hit, seconds)

    def _apply(self) -> None:
        assert self.guard is not None
        self.directory.disabled = self.guard.off()
