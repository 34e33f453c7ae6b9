"""A calibrated profile: what one engine on one machine was measured to cost, in place of the stated defaults.

`kvtier calibrate` writes it; `analyze`, `simulate` and `plan` read it with `--profile`, and the rollout makes one
from its own baseline. It holds fits, each with the points it rests on and how far the points stray from it:

- prefill seconds of `n` new tokens after `p` cached ones: `fixed + per_token·n + per_pair·(n·p + n(n+1)/2)`,
  the cost model's form (a linear term for the weights, a quadratic one for causal attention) with the
  engine's fixed cost per step, which a FLOP count leaves out;
- decode seconds per output token with `b` requests decoding: `base + per_request·b`;
- each tier's load of `k` blocks into the engine (and the store path's copy out of it): `latency + bytes/bandwidth`.

A profile names the machine and the server it was measured on; `differences` says what differs from another, so
a profile from elsewhere is refused or warned about, naming what differs.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 1
MAX_RELATIVE_RMS = 0.25  # a fit whose points stray further than this (rms, relative to each point) fits nothing


class ProfileError(ValueError):
    """A profile that cannot be used: unreadable, of another version, or whose fit does not fit its points."""


@dataclass(frozen=True)
class PrefillFit:
    fixed_s: float
    per_token_s: float
    per_pair_s: float
    points: list[tuple[int, int, float]]  # (new tokens, cached tokens, seconds)
    relative_rms: float  # of the residuals, each relative to its point

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        n, p = new_tokens, cached_tokens
        if n <= 0:
            return 0.0
        return self.fixed_s + self.per_token_s * n + self.per_pair_s * (n * p + n * (n + 1) / 2)

    def scaled(self, factor: float) -> PrefillFit:
        """The same shape on a server `factor` times as slow (one process of the same build can run some percent
        apart from another on a shared machine)."""
        return replace(self, fixed_s=self.fixed_s * factor, per_token_s=self.per_token_s * factor,
                       per_pair_s=self.per_pair_s * factor)


@dataclass(frozen=True)
class LineFit:
    """`intercept + slope·x`: decode seconds per token over the batch, or a transfer's seconds over its bytes."""

    intercept: float
    slope: float
    points: list[tuple[float, float]]  # (x, seconds)
    relative_rms: float

    def seconds(self, x: float) -> float:
        return self.intercept + self.slope * x

    @property
    def bytes_per_s(self) -> float:
        return 1 / self.slope if self.slope > 0 else float("inf")


@dataclass(frozen=True)
class Profile:
    machine: dict[str, Any]
    server: dict[str, Any]  # model, block_size, kv_bytes_per_token, max_model_len, how it was reached
    prefill: PrefillFit
    decode: LineFit
    tiers: dict[str, LineFit] = field(default_factory=dict)  # "host", "disk", "redis": a load of k blocks' bytes
    store: LineFit | None = None  # engine -> host, the store path's copy
    version: int = VERSION

    def as_dict(self) -> dict[str, Any]:
        return {"kvtier_profile": self.version, **{k: v for k, v in asdict(self).items() if k != "version"}}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    def residuals(self) -> dict[str, float]:
        """Each fit's rms residual relative to its points: how well the profile reproduces its own measurements."""
        fits: dict[str, PrefillFit | LineFit] = {"prefill": self.prefill, "decode": self.decode}
        fits.update({f"load from {k}": v for k, v in self.tiers.items()})
        if self.store is not None:
            fits["store"] = self.store
        return {name: fit.relative_rms for name, fit in fits.items()}


def machine_identity() -> dict[str, Any]:
    """What makes timings differ between machines: the CPU, its vector width, its cores, the memory."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine()
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": model, "isa": isa, "cores": os.cpu_count() or 1,
            "memory_bytes": pages * os.sysconf("SC_PAGE_SIZE") if pages else None}


IDENTITY = {"machine": ("cpu", "isa", "cores"), "server": ("model", "block_size", "kv_bytes_per_token")}


def differences(profile: Profile, machine: dict[str, Any] | None = None,
                server: dict[str, Any] | None = None) -> list[str]:
    """What differs between where the profile was measured and `machine`/`server` (keys either side lacks are not
    compared): "machine cpu: 'X' in the profile, 'Y' here"."""
    out = []
    for part, theirs in (("machine", machine), ("server", server)):
        mine = getattr(profile, part)
        for key in IDENTITY[part]:
            if theirs is None or mine.get(key) is None or theirs.get(key) is None:
                continue
            if mine[key] != theirs[key]:
                out.append(f"{part} {key}: {mine[key]!r} in the profile, {theirs[key]!r} here")
    return out


def load_profile(path: Path) -> Profile:
    """A profile file, checked: ProfileError naming the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "kvtier_profile" not in data:
        raise ProfileError(f"{path}: not a kvtier profile (no `kvtier_profile` version field)")
    if data["kvtier_profile"] != VERSION:
        raise ProfileError(f"{path}: kvtier_profile {data['kvtier_profile']!r}: this kvtier reads version {VERSION}")
    try:
        profile = Profile(
            machine=dict(data["machine"]), server=dict(data["server"]),
            prefill=PrefillFit(**{**data["prefill"], "points": [tuple(p) for p in data["prefill"]["points"]]}),
            decode=_line(data["decode"]),
            tiers={name: _line(fit) for name, fit in (data.get("tiers") or {}).items()},
            store=_line(data["store"]) if data.get("store") else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: malformed profile: {type(exc).__name__} {exc}") from None
    for name, rms in profile.residuals().items():
        if not (np.isfinite(rms) and rms <= MAX_RELATIVE_RMS):
            raise ProfileError(f"{path}: {name}: the fit misses its own points by {rms:.0%} rms "
                               f"(at most {MAX_RELATIVE_RMS:.0%})")
    return profile


def _line(data: dict[str, Any]) -> LineFit:
    return LineFit(**{**data, "points": [tuple(p) for p in data["points"]]})


# ------------------------------------------------------------------------------------------------ fitting


def fit_prefill_curve(points: Sequence[tuple[int, int, float]]) -> PrefillFit:
    """Least squares of the prefill form over (new, cached, seconds), each point weighted by 1/seconds (relative
    error: short and long prompts count alike), coefficients kept non-negative."""
    if len(points) < 4:
        raise ProfileError(f"prefill: {len(points)} points, at least 4 are needed to fit 3 coefficients")
    n = np.array([p[0] for p in points], float)
    c = np.array([p[1] for p in points], float)
    y = np.array([p[2] for p in points], float)
    x = np.column_stack([np.ones_like(n), n, n * c + n * (n + 1) / 2])
    coef = _nonnegative_lstsq(x, y)
    return PrefillFit(float(coef[0]), float(coef[1]), float(coef[2]), [(p[0], p[1], p[2]) for p in points],
                      _relative_rms(x @ coef, y))


def fit_line(points: Sequence[tuple[float, float]], what: str) -> LineFit:
    """Least squares of `intercept + slope·x` (relative error, both non-negative)."""
    if len({p[0] for p in points}) < 2:
        raise ProfileError(f"{what}: needs points at two sizes at least, got {len(points)}")
    x = np.column_stack([np.ones(len(points)), [p[0] for p in points]])
    y = np.array([p[1] for p in points], float)
    coef = _nonnegative_lstsq(x, y)
    return LineFit(float(coef[0]), float(coef[1]), [(p[0], p[1]) for p in points], _relative_rms(x @ coef, y))


def checked(fit: PrefillFit | LineFit, what: str) -> PrefillFit | LineFit:
    """`fit`, or ProfileError when it does not fit its own points."""
    if not (np.isfinite(fit.relative_rms) and fit.relative_rms <= MAX_RELATIVE_RMS):
        raise ProfileError(f"{what}: the fit misses its points by {fit.relative_rms:.0%} rms (at most "
                           f"{MAX_RELATIVE_RMS:.0%}): the measurements vary more than the model explains")
    return fit


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Weighted least squares; a coefficient that comes out negative is dropped (0) and the rest refitted."""
    if np.any(y <= 0):
        raise ProfileError("a measured time is not positive")
    w = 1 / y
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        solved, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        coef[keep] = solved
        negative = [k for k in keep if coef[k] < 0]
        if not negative or len(keep) == 1:
            return np.maximum(coef, 0)
        keep.remove(min(negative, key=lambda k: coef[k]))


def _relative_rms(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((predicted - measured) / measured) ** 2)))
