"""Shared tiers are a trust boundary: with `auth_key_env`, only blocks signed with the secret are served.

A checksum is not a signature: whoever can write the Redis server or a disk tier's directory can plant a block
with a valid xxh3. Here an attacker who knows the namespace (it is in the key names and directory names) plants
such blocks; the engine with the secret must treat them as misses, count them, remove them, and still serve its
own blocks exactly. A directory of the tier that someone else could write is refused outright.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvtier.cache import TieredCache
from kvtier.config import ConfigError, parse_config
from kvtier.stores.disk import DiskStore
from kvtier.stores.files import UnsafeDirectory
from kvtier.stores.redis import RedisStore
from tests.conftest import missing
from tests.connector_harness import Engine

SHAPE, DT, P = (4, 1024), torch.uint8, 4096
SECRET = "a secret of more than sixteen bytes"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("KVTIER_TEST_SECRET", SECRET)
    return "KVTIER_TEST_SECRET"


def test_the_secret_must_be_there_and_is_never_shown(monkeypatch):
    with pytest.raises(ConfigError, match="auth_key_env.*KVTIER_NO_SUCH_SECRET is not set"):
        parse_config({"cpu_bytes_to_use": P, "auth_key_env": "KVTIER_NO_SUCH_SECRET"})
    monkeypatch.setenv("KVTIER_SHORT_SECRET", "short")
    with pytest.raises(ConfigError, match="auth_key_env") as err:
        parse_config({"cpu_bytes_to_use": P, "auth_key_env": "KVTIER_SHORT_SECRET"})
    assert "short'" not in str(err.value).replace("KVTIER_SHORT_SECRET", "")


def test_a_block_planted_on_disk_without_the_key_is_a_counted_miss(tmp_path, secret):
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "auth_key_env": secret, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path), "max_bytes": 8 * (P + 4096), "write_policy": "write_through"}]})
    mine = torch.full(SHAPE, 1, dtype=DT)
    with TieredCache(config, SHAPE, DT, model="signed") as cache:
        cache.store([b"mine"], [mine])
        namespace = cache.namespace.digest()
    attacker = DiskStore(tmp_path, namespace, 0, P)  # no key: a valid header and checksum, no valid MAC
    attacker.write(b"planted", None, torch.full((P,), 0x66, dtype=DT))
    attacker.write(b"mine", None, torch.full((P,), 0x66, dtype=DT))  # and one of ours, overwritten
    attacker.close()
    with TieredCache(config, SHAPE, DT, model="signed") as cache:
        assert cache.load([b"planted"]) == [] and cache.load([b"mine"]) == []
        assert cache.snapshot()["integrity_failures"]["disk"] == 2
        assert not any(p.name in (b"planted".hex() + ".kv", b"mine".hex() + ".kv") for p in tmp_path.rglob("*.kv"))
        cache.store([b"mine"], [mine])  # what the engine itself signs is served, exactly
        cache.flush()
    with TieredCache(config, SHAPE, DT, model="signed") as cache:
        got = cache.load([b"mine"])
        assert len(got) == 1 and torch.equal(got[0], mine)


def test_a_block_planted_in_redis_without_the_key_is_a_counted_miss(redis_server, secret):
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "auth_key_env": secret, "secondary_tiers": [
        {"type": "redis", "url": redis_server.url, "max_bytes": 32 * (P + 1024)}]})
    with TieredCache(config, SHAPE, DT, model="signed") as a, TieredCache(config, SHAPE, DT, model="signed") as b:
        a.store([b"mine"], [torch.full(SHAPE, 1, dtype=DT)])
        a.flush()
        attacker = RedisStore(redis_server.url, a.namespace.digest(), P, 32 * (P + 1024))
        attacker.put_many([(b"planted", None, torch.full((P,), 0x66, dtype=DT))])
        attacker.close()
        assert b.lookup([b"planted"]) == 1, "Redis has it: only its MAC tells"
        assert b.load([b"planted"]) == []
        assert b.snapshot()["integrity_failures"]["redis"] == 1
        assert b.lookup([b"planted"]) == 0, "removed"
        got = b.load([b"mine"])
        assert len(got) == 1 and torch.equal(got[0], torch.full(SHAPE, 1, dtype=DT))


def test_signed_and_unsigned_deployments_never_share_blocks(tmp_path, secret):
    def config(**extra):
        return parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, **extra, "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path), "max_bytes": 8 * (P + 4096), "write_policy": "write_through"}]})

    with TieredCache(config(), SHAPE, DT, model="m") as plain:
        plain.store([b"k"], [torch.ones(SHAPE, dtype=DT)])
    with TieredCache(config(auth_key_env=secret), SHAPE, DT, model="m") as signed:
        assert signed.lookup([b"k"]) == 0  # another namespace


@pytest.mark.parametrize("mode, owner", [(0o777, None), (0o700, 65534)])
def test_a_tier_directory_others_could_write_is_refused(tmp_path, mode, owner):
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path), "max_bytes": 8 * (P + 4096)}]})
    with TieredCache(config, SHAPE, DT, model="m") as cache:
        namespace = tmp_path / cache.namespace.digest()
    namespace.chmod(mode)
    if owner is not None:
        if os.geteuid() != 0:  # CI runs as root: there, not being root is a failure
            missing("changing a directory's owner needs root")
        os.chown(namespace, owner, owner)
    with pytest.raises(UnsafeDirectory, match=str(namespace)):
        TieredCache(config, SHAPE, DT, model="m")


def test_a_trusted_network_is_said_at_startup_and_in_metrics(redis_server, secret, caplog):
    """A redis tier without a key served planted blocks and nothing said so (r_redis_plant.py). Now the config
    must say trusted_network, and then the startup lines and `kvtier_shared_tier_authenticated` say it too."""
    def config(top: dict, tier: dict):
        return parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "engine_block_size": 16, **top,
                             "secondary_tiers": [{"type": "redis", "url": redis_server.url,
                                                  "max_bytes": 32 * (P + 1024), **tier}]})

    trusted, signed = config({}, {"trusted_network": True}), config({"auth_key_env": secret}, {})
    caplog.set_level(logging.INFO, logger="kvtier")
    with TieredCache(trusted, SHAPE, DT, model="m") as cache:
        assert b'kvtier_shared_tier_authenticated{tier="redis"} 0.0' in cache.metrics.exposition()
    assert any("trusted_network" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    with TieredCache(signed, SHAPE, DT, model="m") as cache:
        assert b'kvtier_shared_tier_authenticated{tier="redis"} 1.0' in cache.metrics.exposition()
    assert not any("trusted_network" in r.getMessage() for r in caplog.records)
    for cfg, authenticated, said in ((trusted, 0, "trusted_network: blocks unsigned"), (signed, 1, "blocks signed")):
        caplog.clear()
        engine = Engine(cfg)  # the vLLM connector's two halves
        try:
            assert engine.scheduler.stats_payload()["gauges"]["shared_tier_authenticated"] == {"redis": authenticated}
            startup = next(r.getMessage() for r in caplog.records if "namespace" in r.getMessage())
            assert said in startup and f"{redis_server.url} kvtier:" in startup
        finally:
            engine.close()
