"""The self-checking block header every persistent and shared tier writes before a block's payload.

Fields: magic, format version, namespace, key, parent, payload length, xxh3 of the payload, a MAC, and an
xxh3 of all of these. A reader that knows which block it asked for (namespace, key, payload length) can then
tell a valid block from a torn or flipped one (CORRUPT) and from a valid block of someone else (FOREIGN), and
never serves either. The disk tier pads the header to 4096 bytes for O_DIRECT; the Redis tier stores it unpadded.

A checksum is not a signature: whoever can write a shared root_dir or the Redis server can plant a block with
a valid xxh3. With a secret (`auth_key_env`), the MAC is a keyed BLAKE2b of the block's names and its whole
payload, and a reader with the key serves only blocks whose MAC it can recompute (UNAUTHENTICATED otherwise).
Without a secret the MAC is zeros and not checked.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from typing import NamedTuple

import xxhash

from kvtier import FORMAT_VERSION
from kvtier.stores.base import ReadStatus

MAGIC = b"KVTIER\x00\x01"
MAX_KEY = 128  # bytes, for keys and parents alike
MAC_NBYTES = 32
NO_MAC = bytes(MAC_NBYTES)
# magic version ns key_len key has_parent parent_len parent len xxh mac
_FIELDS = struct.Struct(f"<8sI16sH128sBH128sQQ{MAC_NBYTES}s")
_CHECK = struct.Struct("<Q")  # xxh3_64 of the fields above
HEADER_NBYTES = _FIELDS.size + _CHECK.size  # what the header needs; a tier may pad it


class Header(NamedTuple):
    namespace: bytes | None  # None: a kvtier block of another format version
    key: bytes
    parent: bytes | None
    payload_nbytes: int
    payload_xxh3: int
    mac: bytes = NO_MAC


def check_key(key: bytes, what: str = "key") -> None:
    if not valid_key(key):
        raise ValueError(f"{what} must be 1..{MAX_KEY} bytes, got {len(key)}")


def valid_key(key: bytes) -> bool:
    """A key a block's header has room for."""
    return 0 < len(key) <= MAX_KEY


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(
    buf: memoryview | bytearray, namespace: bytes, key: bytes, parent: bytes | None, payload_nbytes: int,
    payload_xxh3: int, mac: bytes = NO_MAC,
) -> None:
    """Write the header into `buf[:HEADER_NBYTES]`; bytes after it are the caller's (padding or payload)."""
    p = parent or b""
    fields = _FIELDS.pack(
        MAGIC, FORMAT_VERSION, namespace, len(key), key, parent is not None, len(p), p, payload_nbytes, payload_xxh3,
        mac,
    )
    buf[: len(fields)] = fields
    _CHECK.pack_into(buf, len(fields), xxhash.xxh3_64_intdigest(fields))


def parse_header(buf: bytes | memoryview) -> Header | None:
    """The header's fields, or None when torn or not a kvtier header.

    A kvtier header of another format version is returned with namespace None (foreign, not corrupt).
    """
    if len(buf) < HEADER_NBYTES or bytes(buf[:8]) != MAGIC:
        return None
    _magic, version, ns, klen, key, has_parent, plen, parent, length, xxh, mac = _FIELDS.unpack_from(buf)
    if version != FORMAT_VERSION:
        return Header(None, b"", None, 0, 0)
    (check,) = _CHECK.unpack_from(buf, _FIELDS.size)
    if check != xxhash.xxh3_64_intdigest(buf[: _FIELDS.size]) or has_parent > 1:
        return None
    if not 0 < klen <= MAX_KEY or plen > MAX_KEY or (has_parent and plen == 0):
        return None
    return Header(ns, key[:klen], parent[:plen] if has_parent else None, length, xxh, mac)


def classify(
    header: Header | None, namespace: bytes, names_key: Callable[[bytes], bool], payload_nbytes: int, size_ok: bool
) -> ReadStatus:
    """OK when the header is ours (namespace), is the block we asked for (`names_key(header.key)`), and its
    length matches both what we expect and what is stored (`size_ok`). Headers only: see `payload_ok`."""
    if header is None:
        return ReadStatus.CORRUPT
    if header.namespace != namespace or not names_key(header.key):
        return ReadStatus.FOREIGN
    if header.payload_nbytes != payload_nbytes or not size_ok:
        return ReadStatus.CORRUPT
    return ReadStatus.OK


def payload_ok(header: Header, payload: bytes | memoryview) -> bool:
    """The payload is the one the header describes (length and checksum)."""
    return len(payload) == header.payload_nbytes and payload_checksum(payload) == header.payload_xxh3


def mac_of(secret: bytes, namespace: bytes, key: bytes, parent: bytes | None, payload: bytes | memoryview) -> bytes:
    """The keyed BLAKE2b of a block: its names, each with its length in front, then its whole payload."""
    mac = hashlib.blake2b(key=secret, digest_size=MAC_NBYTES, person=b"kvtier-block")
    for part in (namespace, key, parent if parent is not None else b""):
        mac.update(len(part).to_bytes(2, "big") + part)
    mac.update(b"\x01" if parent is not None else b"\x00")
    mac.update(payload)
    return mac.digest()


def authentic(header: Header, payload: bytes | memoryview, secret: bytes | None) -> bool:
    """Without a secret every block is; with one, only those whose MAC it recomputes."""
    if secret is None:
        return True
    assert header.namespace is not None
    return hmac.compare_digest(header.mac, mac_of(secret, header.namespace, header.key, header.parent, payload))
