"""The configurations a simulation compares, as the JSON a user would deploy.

A configuration is the `kv_connector_extra_config` object itself (or None: the engine's own cache only), so
the recommended one can be printed as the `--kv-transfer-config` to pass to vLLM. It is validated by the
same `parse_config` the runtime uses; a simulation writes no files, so fs tiers are validated against a
scratch directory instead of their `root_dir`, which may not exist on the machine that simulates.
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError, KVTierConfig, parse_config

CONNECTOR = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
             "kv_role": "kv_both"}
DISK_ROOT = "/mnt/kv_cache"  # a placeholder in built-in configurations: set your own


@dataclass(frozen=True)
class SimConfig:
    name: str
    extra: dict[str, Any] | None  # kv_connector_extra_config; None = engine only

    def tiers(self) -> int:
        """Tiers beyond the engine's: what a replay's time grows with."""
        return 0 if self.extra is None else 1 + len(self.extra.get("secondary_tiers") or [])

    def validated(self, scratch: Path) -> KVTierConfig | None:
        """The runtime's config object for this JSON, with fs tiers pointed at `scratch`."""
        if self.extra is None:
            return None
        data = copy.deepcopy(self.extra)
        for i, tier in enumerate(data.get("secondary_tiers") or []):
            if isinstance(tier, dict) and tier.get("type") == "fs" and "root_dir" in tier:
                tier["root_dir"] = str(scratch / f"tier{i}")
        try:
            return parse_config(data)
        except ConfigError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """What to pass to `vllm serve --kv-transfer-config`."""
        return None if self.extra is None else {**CONNECTOR, "kv_connector_extra_config": self.extra}


def load_config_file(path: str | Path) -> SimConfig:
    """A config file: the extra config alone, or a whole `--kv-transfer-config` object holding it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "kv_connector_extra_config" in data:
        data = data["kv_connector_extra_config"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    config = SimConfig(path.name, data)
    with tempfile.TemporaryDirectory(prefix="kvtier-sim-") as scratch:
        config.validated(Path(scratch))  # fail early, naming the file and the field
    return config


def host_config(block_tokens: int, host_bytes: int) -> dict[str, Any]:
    """A host tier of `host_bytes` for blocks of the trace's size (the engine's blocks as large when 16 does not
    divide them)."""
    host: dict[str, Any] = {"cpu_bytes_to_use": host_bytes, "block_size": block_tokens}
    if block_tokens % 16:
        host["engine_block_size"] = block_tokens
    return host


def builtin_configs(block_tokens: int, host_bytes: int, disk_bytes: int, with_priority: bool) -> list[SimConfig]:
    """One change at a time: engine only, + host (each policy, second-sighting admission), + host + disk (the
    disk's admission auto, and on the 1st sighting)."""
    host = host_config(block_tokens, host_bytes)
    disk = {"type": "fs", "root_dir": DISK_ROOT, "max_bytes": disk_bytes}
    configs = [
        SimConfig("engine only", None),
        SimConfig("+ host (lru)", host),
        SimConfig("+ host (arc)", {**host, "eviction_policy": "arc"}),
        SimConfig("+ host (s3fifo)", {**host, "eviction_policy": "s3fifo"}),
        SimConfig("+ host (lru, 2nd sighting)", {**host, "admit_after_sightings": 2}),
    ]
    if with_priority:
        configs.append(SimConfig("+ host (priority)", {**host, "eviction_policy": "priority"}))
    configs += [
        # the disk's admission as by default (auto), and admitting every eviction: what auto's caution costs
        SimConfig("+ host + disk", {**host, "secondary_tiers": [disk]}),
        SimConfig("+ host + disk (1st sighting)",
                  {**host, "secondary_tiers": [{**disk, "admission": {"min_sightings": 1}}]}),
    ]
    return configs
