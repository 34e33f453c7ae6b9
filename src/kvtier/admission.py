"""Admission: whether a block is stored in (or demoted to) a tier at all.

Three rules, each named in metrics when it rejects: a minimum priority (TensorRT-LLM's
`secondary_offload_min_priority`), a seen-count ("store on the second sighting") and a transfer budget in
bytes per second (a token bucket on the tier's write path, so a burst of demotions cannot saturate the
link that loads need).

The seen-count can adapt (`min_sightings: auto`): a tier below host admits blocks on their first sighting
only while blocks offered to it come back, served by it or asked for again after it refused them. Unique
traffic then writes nothing a second sighting would not, and reused traffic keeps the tier's hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REUSE_WINDOW = 4096  # offers; older evidence of reuse counts half, then a quarter...
REUSE_TO_ADMIT = 1 / 16  # blocks that came back per block offered, at and above which first sightings are admitted


@dataclass
class AdmissionRule:
    min_priority: int = 0
    min_sightings: int = 1
    max_bytes_per_s: float | None = None
    adaptive: bool = False  # first sightings too, while offered blocks come back (else `min_sightings`)
    _offers: float = field(default=0.0, repr=False)
    _returns: float = field(default=0.0, repr=False)
    _tokens: float = field(default=0.0, repr=False)
    _last: float | None = field(default=None, repr=False)

    def reject_reason(self, priority: int, sightings: int, nbytes: int, now: float) -> str | None:
        """None admits (and spends the budget); otherwise the rule that said no."""
        if priority < self.min_priority:
            return "priority"
        if sightings < self.sightings_needed:
            return "sightings"
        if self.max_bytes_per_s is not None:
            burst = max(self.max_bytes_per_s, float(nbytes))  # one second of budget, at least one block
            if self._last is None:
                self._tokens = burst
            else:
                self._tokens = min(burst, self._tokens + (now - self._last) * self.max_bytes_per_s)
            self._last = now
            if self._tokens < nbytes:
                return "budget"
            self._tokens -= nbytes
        return None

    @property
    def counts_sightings(self) -> bool:
        return self.adaptive or self.min_sightings > 1

    @property
    def sightings_needed(self) -> int:
        if self.adaptive and self._returns >= REUSE_TO_ADMIT * max(self._offers, 1.0):
            return 1
        return self.min_sightings

    def offered(self) -> None:
        """A block was offered to the tier (admitted or not)."""
        self._offers += 1
        if self._offers >= REUSE_WINDOW:
            self._offers /= 2
            self._returns /= 2

    def came_back(self) -> None:
        """A block was read from the tier, or seen again while no tier held it."""
        self._returns += 1
