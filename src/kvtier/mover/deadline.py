"""Loads under a deadline: each tier's part of a load may take at most that tier's `load_timeout_s`. Past it the
load returns without that part's blocks (the caller recomputes them), and nothing the part does later reaches the
caller. A hung tier then costs a request its deadline, never a hang.

- A step of an expired part that has not started never runs: it is reported failed at once.
- A step that reads into the caller's blocks is reported failed at once; if it runs on, its bytes are refused at
  the load's `Gate`, which closes only once the copies into those blocks that began are done.
- A step that writes into a tier (a staged copy into a host slot, an eviction's write) keeps its slot or file
  until it ends, and reports then: a slot is never reused while a transfer may still write it.

Every step is reported once: a report that comes after the deadline reported its step is dropped.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import Enum

from kvtier.directory import CALLER, Step


class _State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    EXPIRED = "expired"  # reported failed by its deadline


class Deadlines:
    """The steps of loads under a deadline, from their load's start until each is reported once. Steps are known
    by identity (a plan built by hand may leave every id 0), and kept alive while known."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[int, tuple[Step, _State]] = {}  # id(step) -> (step, state)

    def watch(self, steps: Iterable[Step]) -> None:
        with self._lock:
            for step in steps:
                self._steps[id(step)] = (step, _State.WAITING)

    def start(self, step: Step) -> bool:
        """May `step` run? No once its part expired: then it was reported, and the caller skips it unreported."""
        with self._lock:
            known = self._steps.get(id(step))
            if known is None:
                return True
            if known[1] is _State.EXPIRED:
                del self._steps[id(step)]
                return False
            self._steps[id(step)] = (step, _State.RUNNING)
            return True

    def expire(self, steps: Iterable[Step]) -> list[Step]:
        """An expired part's steps that are to be reported failed now: those waiting, and those running into the
        caller's blocks. The others write a tier, and report when they end."""
        gone = []
        with self._lock:
            for step in steps:
                known = self._steps.get(id(step))
                state = known[1] if known else None
                if state is _State.WAITING or (state is _State.RUNNING and step.dst == CALLER):
                    self._steps[id(step)] = (step, _State.EXPIRED)
                    gone.append(step)
        return gone

    def reported(self, steps: Sequence[Step]) -> list[Step]:
        """The steps of a report to pass on: all but those their deadline reported already."""
        passed = []
        with self._lock:
            if not self._steps:  # no load under a deadline now (a store's report, a host tier's load)
                return list(steps)
            for step in steps:
                known = self._steps.pop(id(step), None)
                if known is None or known[1] is not _State.EXPIRED:
                    passed.append(step)
        return passed

    def __len__(self) -> int:
        with self._lock:
            return len(self._steps)


class Gate:
    """The caller's blocks of one load: a block's gate closes when its part expires, after the copies into it
    that began have ended; no copy into it begins after."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed: set[int] = set()
        self._copying: Counter[int] = Counter()

    @contextmanager
    def open(self, index: int) -> Iterator[bool]:
        """True: the caller's block `index` may be written until the block ends; False: it is closed."""
        with self._cond:
            if index in self._closed:
                allowed = False
            else:
                allowed = True
                self._copying[index] += 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._cond:
                    self._copying[index] -= 1
                    self._cond.notify_all()

    def close(self, indices: Iterable[int]) -> None:
        indices = set(indices)
        with self._cond:
            self._closed |= indices
            self._cond.wait_for(lambda: not any(self._copying[i] for i in indices))

    @property
    def closed(self) -> frozenset[int]:
        with self._cond:
            return frozenset(self._closed)
