"""What a rollout is asked to do, checked before any server starts: a bad value is a ValueError naming its flag
(exit 2 from the CLI)."""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier.rollout.sizes import bytes_per_token, headroom_now

STEPS = ("reference", "baseline", "headroom", "host", "host+disk", "rollback")
KVTIER_STEPS = ("host", "host+disk", "rollback")


@dataclass(frozen=True)
class Options:
    requests: int = 40  # per level
    levels: tuple[int, ...] = (1, 2)  # closed-loop clients; level 1 is one request at a time
    think_s: float | None = None  # each client's mean think time; None: from the measured service time
    rates: tuple[float, ...] = ()  # open loop instead: Poisson arrivals at these fractions of the measured capacity
    max_tokens: int = 8
    trace: Path | None = None
    command: str | None = None  # a template (`kvtier.rollout.server`); None: the embedded tiny model
    model: str | None = None  # the served model: a folder (the embedded server serves it), a config.json, a preset
    steps: tuple[str, ...] = STEPS
    ttft_budget_ms: float | None = None  # None: 1.5 x the baseline's worst p99 over the levels it carried
    host_bytes: int | None = None  # None: at the elbow of the workload's reuse curve, within the host's headroom
    disk_bytes: int | None = None  # None: the rest of what the workload reuses
    disk_root: Path | None = None  # None: a temp folder of the rollout's
    kv_config: Path | None = None  # a JSON object: step name -> the whole kv_connector_extra_config of that step
    seed: int = 0
    predict: bool = True  # calibrate on the first server and predict each level before sending it
    profile: Path | None = None  # the predictions' costs from this profile instead of calibrating

    @property
    def loads(self) -> int:
        return len(self.rates) if self.rates else len(self.levels)

    def check(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"--steps: unknown step {unknown[0]!r} (known: {', '.join(STEPS)})")
        if self.requests <= 0 or self.max_tokens <= 0 or any(c <= 0 for c in self.levels):
            raise ValueError("--requests, --max-tokens and every --levels value must be > 0")
        if any(not (0 < r < 1 and math.isfinite(r)) for r in self.rates):
            raise ValueError(f"--rates: fractions of the measured capacity, each in (0, 1): {self.rates}")
        if self.think_s is not None and not (0 <= self.think_s < math.inf):
            raise ValueError(f"--think-s: a number of seconds >= 0, got {self.think_s}")
        if self.command and "{port}" not in self.command:
            raise ValueError("--command: the template needs {port} (and {kv_transfer_config} for kvtier's steps)")
        if self.profile is not None:
            from kvtier.sim.profile import load_profile

            load_profile(self.profile)  # a bad profile is named before any server starts
        if self.command and "reference" in self.steps:
            raise ValueError("--steps: 'reference' needs the embedded server (it sets the engine cache size)")
        self._check_tiers()

    def _check_tiers(self) -> None:
        """The flags that size and place the tiers."""
        for flag, value in (("--host-bytes", self.host_bytes), ("--disk-bytes", self.disk_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag}: a number of bytes > 0, got {value}")
        if self.disk_root is not None:
            _writable(self.disk_root)
        if self.kv_config is not None:
            step_configs(self.kv_config)
        if self.command and self.model is not None:
            bytes_per_token(self.model)
        if self.command and self.model is None and self.tiers_sized:
            raise ValueError("--model: needed with --command to size the tiers in the served model's bytes (a "
                             "preset, or the model's config.json), unless --host-bytes and --disk-bytes are given")
        if self.host_bytes is not None and self.host_bytes > (left := headroom_now()):
            raise ValueError(f"--host-bytes {self.host_bytes:,}: over what this host can give now ({left:,} bytes: "
                             "available memory less a tenth of the host)")

    @property
    def tiers_sized(self) -> bool:
        """The kvtier steps' tiers need the model's bytes per token: they are sized from the workload."""
        kv = step_configs(self.kv_config) if self.kv_config else {}
        wanted = [s for s in self.steps if s in KVTIER_STEPS and s not in kv]
        host = self.host_bytes is None and wanted
        disk = self.disk_bytes is None and any(s != "host" for s in wanted)
        return bool(host or disk)


def step_configs(path: Path) -> dict[str, dict]:
    """`--kv-config`: {"host": {...}, "host+disk": {...}}, each step's whole kv_connector_extra_config."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--kv-config {path}: {exc}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"--kv-config {path}: expected a JSON object of step name -> config object")
    unknown = [k for k in raw if k not in KVTIER_STEPS]
    if unknown:
        raise ValueError(f"--kv-config {path}: {unknown[0]!r} is not a step with tiers ({', '.join(KVTIER_STEPS)})")
    return raw


def _writable(folder: Path) -> None:
    if not folder.is_dir():
        raise ValueError(f"--disk-root {folder}: no such folder")
    try:  # a file made and removed: permission bits do not say it for root, nor for a file system mounted read-only
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"--disk-root {folder}: not writable ({e.strerror})") from None
