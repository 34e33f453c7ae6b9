"""Where the public traces are: $KVTIER_TRACES_DIR, or a `shared/traces` folder beside the repository (or
beside any folder above it, or above the working directory), as the project lays them out."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def shared_traces_dir() -> Path:
    """The first candidate folder that exists (else the first candidate, for the error message)."""
    candidates = [Path(os.environ["KVTIER_TRACES_DIR"])] if os.environ.get("KVTIER_TRACES_DIR") else []
    for start in (REPO, Path.cwd()):
        candidates += [parent / "shared" / "traces" for parent in (start, *start.parents)]
    candidates.append(Path("/work/shared/traces"))
    return next((c for c in candidates if c.is_dir()), candidates[0])
