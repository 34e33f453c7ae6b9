"""Block keys and namespaces.

A key names a block *and its whole prefix*: sha256(parent key + the block's token ids + extra keys).
Engines that already hash their blocks (vLLM's `request.block_hashes`) hand us those keys as they are:
re-hashing would lose the engine's own tenant and LoRA isolation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from kvtier import FORMAT_VERSION

ROOT_KEY = b"\x00" * 32  # the parent of every chain's first block
TOKEN_TYPECODE = "I"  # uint32: every vocabulary in use fits
assert array(TOKEN_TYPECODE).itemsize == 4


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes = ROOT_KEY,
    extra_keys: Sequence[bytes | str] = (),
) -> list[bytes]:
    """Keys of every *full* block of `token_ids`; a trailing partial block has no key.

    `extra_keys` (a cache salt, a LoRA name, multimodal hashes) go into every block, each with its length in
    front, so two tenants with different salts never share a key even for identical tokens.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    extra = b"".join(_delimited(e.encode() if isinstance(e, str) else bytes(e)) for e in extra_keys)
    tokens = array(TOKEN_TYPECODE, token_ids).tobytes()
    width = block_size * 4
    keys: list[bytes] = []
    for start in range(0, len(tokens) - width + 1, width):
        parent = hashlib.sha256(parent + tokens[start : start + width] + extra).digest()
        keys.append(parent)
    return keys


def _delimited(part: bytes) -> bytes:
    """A part with its length in front: two different lists of extra keys never hash alike."""
    return len(part).to_bytes(4, "big") + part


def chain_route(keys: Sequence[bytes], blocks: int) -> bytes | None:
    """The key that picks a chain's partition in a partitioned shared tier (Redis Cluster): its `blocks`-th key,
    or its last for a shorter chain; None for no chain. Every engine computes it from the same first tokens, so
    chains that share those tokens share a partition (and the blocks of one chain are never split)."""
    return keys[min(blocks, len(keys)) - 1] if keys and blocks > 0 else None


def precomputed_keys(hashes: Iterable[bytes | int], group: int | None = None, salt: bytes = b"") -> list[bytes]:
    """Engine-made block hashes used as keys without re-hashing (ints become 16 big-endian bytes).

    `group` (vLLM's KV-cache group id) is appended so that groups of a hybrid model never collide; `salt` after it
    (a cache generation).
    """
    suffix = (b"" if group is None else group.to_bytes(2, "big")) + salt
    return [(h.to_bytes(16, "big", signed=False) if isinstance(h, int) else bytes(h)) + suffix for h in hashes]


@dataclass(frozen=True)
class Namespace:
    """Everything that makes stored bytes incompatible. Persistent and shared tiers are partitioned by it."""

    model: str
    dtype: str
    block_size: int
    kv_layout: str = "blocks"
    rank: int = 0
    world_size: int = 1
    hash_algo: str = "sha256"
    tenant_salt: str = ""
    auth: str = ""  # a fingerprint of the key that signs blocks, if any (KVTierConfig.auth_fingerprint)
    format_version: int = FORMAT_VERSION

    def digest(self) -> str:
        """32 hex chars: a directory name on disk and a key prefix in shared stores."""
        fields = "\x1f".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(fields.encode()).hexdigest()[:32]
