"""Admission: whether a block is stored in (or demoted to) a tier at all.

Three rules, each named in metrics when it rejects: a minimum priority (TensorRT-LLM's
`secondary_offload_min_priority`), a seen-count ("store on the second sighting") and a transfer budget in
bytes per second (a token bucket on the tier's write path, so a burst of demotions cannot saturate the
link that loads need).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdmissionRule:
    min_priority: int = 0
    min_sightings: int = 1
    max_bytes_per_s: float | None = None
    _tokens: float = field(default=0.0, repr=False)
    _last: float | None = field(default=None, repr=False)

    def reject_reason(self, priority: int, sightings: int, nbytes: int, now: float) -> str | None:
        """None admits (and spends the budget); otherwise the rule that said no."""
        if priority < self.min_priority:
            return "priority"
        if sightings < self.min_sightings:
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
