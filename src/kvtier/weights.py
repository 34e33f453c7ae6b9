"""What identifies a model's weights, for the namespace: KV computed with other weights must never be served.

A path names a folder, not its contents: a new checkpoint at the same path must be another namespace, and the
same checkpoint at another path the same one. So the identity is a digest of the model's config (without the
fields that name where it came from), its quantization, and of every weight file: its name and a digest of every
byte it holds (`kvtier.digests`). A checkpoint updated in place, one tensor anywhere, is another model; a restart
over unchanged files reads nothing again, their digests being remembered by file identity. A model named by a hub
id is identified by the snapshot of the hub's cache it was loaded from (`hub_snapshot`), never by its name or a
revision label, under which other bytes can be uploaded. Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from kvtier.digests import FileDigests

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
UNSTABLE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class NoWeights(ValueError):
    """A folder without a weight file: nothing that could identify the weights."""


def weight_files(folder: Path) -> list[Path]:
    """Every weight file under `folder` (links followed, as the engine's loader follows them), sorted."""
    return sorted(p for p in folder.rglob("*") if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())


def weights_identity(folder: str | Path, config: Mapping[str, Any] | None = None, quantization: str | None = None,
                     digests: FileDigests | None = None) -> str:
    """32 hex chars naming the weights `folder` holds: its config, quantization, and every byte of every weight file
    (`digests`: where the files' digests are remembered; default `FileDigests()`). NoWeights if it holds none."""
    folder = Path(folder)
    files = weight_files(folder) if folder.is_dir() else []
    if not files:
        raise NoWeights(f"{folder}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) that could identify the weights")
    digest = xxhash.xxh3_128()
    stable = {k: v for k, v in (config or {}).items() if k not in UNSTABLE_CONFIG_KEYS}
    digest.update(json.dumps(stable, sort_keys=True, default=str).encode())
    digest.update(f"\0quantization={quantization}\0".encode())
    for path, file_digest in zip(files, (digests or FileDigests()).digests(files)):
        digest.update(f"\0{path.relative_to(folder)}\0".encode())
        digest.update(file_digest)
    return digest.hexdigest()


def hub_snapshot(repo_id: str, revision: str | None, cache: Path, commit: str | None = None) -> Path | None:
    """The folder of a Hugging Face hub cache (`cache`: HF_HUB_CACHE, or the engine's download_dir) that an engine
    loaded `repo_id` at `revision` from: `snapshots/<commit>`, the commit `refs/<revision>` names (or `revision`
    itself, a commit hash). `commit`: the one the engine's config came from (its `_commit_hash`), which must be
    that one. None where there is no such folder, or the two commits differ (the label moved since: which
    snapshot the engine read cannot be told)."""
    revision = revision or "main"
    if repo_id.startswith("/") or ".." in Path(revision).parts or ".." in Path(repo_id).parts:
        return None
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    found = revision if _COMMIT.fullmatch(revision) else None
    if found is None:
        try:
            found = (storage / "refs" / revision).read_text().strip()
        except OSError:
            found = commit
    if found is None or not _COMMIT.fullmatch(found) or (commit is not None and commit != found):
        return None
    folder = storage / "snapshots" / found
    return folder if folder.is_dir() else None
