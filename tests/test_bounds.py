"""Bounds and leaks ("Trust, second round"): every tier within its bytes, even across a stop and a namespace
change; every queue bounded; every step of every plan reported, whatever raises; nothing kept for a block no tier
holds. Each test drives the real halves of the connector (`tests.connector_harness`) or the real cache, on real
files and a real redis-server."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvtier.config import parse_config
from kvtier.integrations.vllm.scheduler import SchedulerSide
from tests.connector_harness import TOKENS, Engine, Request, geometry, loading_all


def h(*path: object) -> bytes:
    return hashlib.blake2b(repr(path).encode(), digest_size=16).digest()


@dataclass
class TokenRequest(Request):
    """A request whose tokens KV events announce."""

    @property
    def all_token_ids(self) -> list[int]:
        return list(range(self.num_tokens))


def test_kv_events_keep_no_payload_of_a_block_whose_store_was_refused():
    """KV events remember the engine's view (hashes, tokens) of a block when its store is planned, and forget it
    when the block leaves the directory. A block whose store was refused (here: stored on its second sighting;
    each turn of a session adds a block seen once) never enters the directory, so it never left it either: its
    payload stayed for good, one per session (200 of 264 kept before)."""
    config = parse_config({"cpu_bytes_to_use": 64 * 4096, "block_size": TOKENS, "engine_block_size": TOKENS,
                           "admit_after_sightings": 2})
    engine = Engine(config, num_blocks=64)
    engine.scheduler = SchedulerSide(loading_all(config), geometry(1), kv_events=True)
    try:
        for session in range(50):  # turn t's prompt is the session's first t + 1 blocks
            for turn in range(4):
                r = TokenRequest(f"s{session}t{turn}", [h("s", session, i) for i in range(turn + 1)])
                assert engine.admit(r)
                engine.run(r)
        engine.drain()
        events, directory = engine.scheduler.events, engine.scheduler.directory
        assert events is not None
        assert [key for key in events.payloads if key not in directory] == []
        assert len(events.payloads) <= len(directory)
        assert events.take(), "blocks were stored and announced"
    finally:
        engine.close()
