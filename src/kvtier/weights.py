"""What identifies a model's weights, for the namespace: KV computed with other weights must never be served.

A path names a folder, not its contents: a new checkpoint at the same path must be another namespace, and the
same checkpoint at another path the same one. So the identity is a digest of the model's config (without the
fields that name where it came from), its quantization and revision, and of every weight file: its name, its
size, and a checksum we can afford at startup (the safetensors header, and samples spread over the file: a
fine-tuned checkpoint of the same shapes changes them with overwhelming probability, reading only a few MiB of
even a large checkpoint). Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16  # chunks hashed per weight file, spread from its start to its end
SAMPLE_BYTES = 64 << 10
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one (the format caps it lower)
UNSTABLE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")
log = logging.getLogger(__name__)


def weights_identity(model: str | Path, config: Mapping[str, Any] | None = None, quantization: str | None = None,
                     revision: str | None = None) -> str:
    """32 hex chars naming the weights `model` holds (a folder), or, for a name that is not a folder here (a hub
    id), naming that name, its revision and its config: then only as good as the name."""
    digest = xxhash.xxh3_128()
    stable = {k: v for k, v in (config or {}).items() if k not in UNSTABLE_CONFIG_KEYS}
    digest.update(json.dumps(stable, sort_keys=True, default=str).encode())
    digest.update(f"\0quantization={quantization}\0revision={revision}\0".encode())
    folder = Path(model)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)) \
        if folder.is_dir() else []
    if not files:
        log.warning("kvtier: no weight files under %r: the namespace names the model by its name and config only",
                    str(model))
        digest.update(f"\0name={model}".encode())
    for path in files:
        digest.update(f"\0{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        digest.update(file_fingerprint(path))
    return digest.hexdigest()


def file_fingerprint(path: Path) -> bytes:
    """The safetensors header (names, dtypes, shapes, offsets) and SAMPLES chunks spread over the file."""
    size = path.stat().st_size
    out = xxhash.xxh3_128()
    with open(path, "rb") as f:
        head = f.read(8)
        if path.suffix == ".safetensors" and len(head) == 8 and (n := int.from_bytes(head, "little")) < HEADER_MAX:
            out.update(f.read(n))
        for i in range(SAMPLES):
            f.seek(max(0, size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1))
            out.update(f.read(SAMPLE_BYTES))
    return out.digest()
