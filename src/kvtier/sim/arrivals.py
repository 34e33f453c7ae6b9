"""When the simulator's requests arrive: at a trace's timestamps, or from closed-loop clients.

A trace fixes its arrivals. Closed-loop clients do not: each sends its next request once its last one has ended
and it has thought, so a slower server sees later arrivals, as the rollout's clients do (`rollout/client.py`).
`ClosedLoop` draws the same think times as those clients, from the same seeds, and gives request `i` to the
client that frees first, as they take prompts in order: the arrivals follow from the simulated latencies.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Protocol


class Arrivals(Protocol):
    def arrive(self, i: int, timestamp: float) -> float:
        """When request `i` (of the trace's `timestamp`) is sent."""
        ...

    def ended(self, i: int, at: float) -> None:
        """Request `i` got its last token at `at`."""
        ...


class AtTimestamps:
    """The trace's own arrivals."""

    def arrive(self, i: int, timestamp: float) -> float:
        return timestamp

    def ended(self, i: int, at: float) -> None:
        pass


@dataclass(frozen=True)
class ClosedLoop:
    """`clients` clients, each thinking an exponential time of mean `think_s` between its requests; `seed`: the
    rollout client's seed, so that each client thinks the same times as it."""

    clients: int
    think_s: float = 0.0
    seed: int = 0

    def start(self) -> ClosedLoopClients:
        return ClosedLoopClients(self)


class ClosedLoopClients:
    """One simulation's clients: when each is free, and its own think-time draws."""

    def __init__(self, loop: ClosedLoop) -> None:
        self.think_s = loop.think_s
        self.free: list[tuple[float, int]] = [(0.0, c) for c in range(max(1, loop.clients))]
        self.thinks = [random.Random(f"{loop.seed}/client/{c}") for c in range(max(1, loop.clients))]
        self.client_of: dict[int, int] = {}

    def arrive(self, i: int, timestamp: float) -> float:
        at, client = heapq.heappop(self.free)
        self.client_of[i] = client
        return at

    def ended(self, i: int, at: float) -> None:
        client = self.client_of.pop(i)
        think = self.thinks[client].expovariate(1 / self.think_s) if self.think_s > 0 else 0.0
        heapq.heappush(self.free, (at + think, client))
