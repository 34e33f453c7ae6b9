"""Bad configuration gets a clear error naming the field; the CLI exits 2 and changes nothing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvtier.cli import main
from kvtier.cli.main import _parser as cli_parser
from kvtier.config import ConfigError, parse_config, parse_guard
from kvtier.sizing import tier_specs

GOOD = {"cpu_bytes_to_use": 1 << 20, "block_size": 256}


def fs(tmp_path, **extra):
    return {"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": 1 << 30, **extra}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"cpu_bytes_to_use": -1}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"block_size": 0}, "block_size"),
        ({"eviction_policy": "mru"}, "eviction_policy"),
        ({"block_size": 100}, "multiple of the engine's block size"),
        ({"secondary_offload_min_priority": 101}, "secondary_offload_min_priority"),
        ({"cpu_bytes": 5}, "cpu_bytes"),
    ],
)
def test_bad_values_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        parse_config({**GOOD, **change})


def test_bad_tiers_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].max_bytes"):
        parse_config({**GOOD, "secondary_tiers": [fs(tmp_path, max_bytes=0)]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]: unknown tier type 's3'"):
        parse_config({**GOOD, "secondary_tiers": [{**fs(tmp_path), "type": "s3"}]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].eviction_policy"):
        parse_config({**GOOD, "secondary_tiers": [fs(tmp_path, eviction_policy="random")]})
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].root_dir: not a writable directory"):
        parse_config({**GOOD, "secondary_tiers": [{**fs(tmp_path), "root_dir": str(blocker / "kv")}]})


def test_a_disk_tier_admits_on_auto_sightings_unless_told_a_number(tmp_path):
    budget_only = fs(tmp_path, admission={"max_write_bytes_per_s": 1 << 30})
    every = {**fs(tmp_path), "root_dir": str(tmp_path / "kv1"), "admission": {"min_sightings": 1}}
    config = parse_config({**GOOD, "secondary_tiers": [budget_only, every]})
    host, disk, disk1 = (spec.admission for spec in tier_specs(config, 4096))
    assert disk.adaptive and disk.sightings_needed == 2  # until blocks offered to the disk come back
    assert not disk1.adaptive and disk1.sightings_needed == 1
    assert not host.adaptive and host.sightings_needed == 1
    redis = {"type": "redis", "url": "redis://127.0.0.1:6379", "max_bytes": 1 << 30,
             "admission": {"min_sightings": "auto"}}  # written through at store time: nothing to learn from
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].admission.min_sightings"):
        parse_config({**GOOD, "secondary_tiers": [redis]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].admission.min_sightings"):
        parse_config({**GOOD, "secondary_tiers": [fs(tmp_path, admission={"min_sightings": "often"})]})


def test_vllm_and_tensorrt_names(tmp_path):
    config = parse_config({"host_cache_size": 4096, "secondary_offload_min_priority": 30,
                           "secondary_tiers": [fs(tmp_path, n_read_threads=32, n_write_threads=16)]})
    assert config.cpu_bytes_to_use == 4096 and config.host_admission.min_priority == 30
    assert config.secondary_tiers[0].n_read_threads == 32


def test_cli_config_exit_codes(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**GOOD, "eviction_policy": "mru"}))
    assert main(["config", str(bad)]) == 2
    assert "eviction_policy" in capsys.readouterr().err
    assert main(["config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    bad.write_text("{not json")
    assert main(["config", str(bad)]) == 2
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD))
    assert main(["config", str(good)]) == 0
    assert '"eviction_policy": "lru"' in capsys.readouterr().out
    whole = tmp_path / "transfer.json"  # what operators pass to vllm serve --kv-transfer-config
    whole.write_text(json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {**GOOD, "eviction_policy": "arc"}}))
    assert main(["config", str(whole)]) == 0
    assert '"eviction_policy": "arc"' in capsys.readouterr().out
    whole.write_text(json.dumps({"kv_connector_extra_config": {**GOOD, "block_size": 0}}))
    assert main(["config", str(whole)]) == 2
    assert "block_size" in capsys.readouterr().err
    plain = tmp_path / "plain.json"  # inside vLLM's CPU engine (--block-size 128), as the connector reads it
    plain.write_text(json.dumps({"kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}))
    assert main(["config", str(plain), "--block-size", "128"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["block_size"] == 128 and shown["engine_block_size"] == 128
    plain.write_text(json.dumps({"cpu_bytes_to_use": 1 << 30, "block_size": 100}))
    assert main(["config", str(plain), "--block-size", "128"]) == 2
    assert "multiple of the engine's block size (128)" in capsys.readouterr().err
    plain.write_text(json.dumps({"cpu_bytes_to_use": 1 << 30, "engine_block_size": 16}))
    assert main(["config", str(plain), "--block-size", "128"]) == 2
    assert "engine_block_size: 16 but vLLM's block size is 128" in capsys.readouterr().err


def test_cli_demo_with_bad_config_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**GOOD, "secondary_tiers": [fs(tmp_path, max_bytes=-5)]}))
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--in-process", "--config", str(bad),
                           "--json", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    assert "secondary_tiers[0].max_bytes" in proc.stderr
    assert not out.exists()


def test_cli_help_explains_itself():
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for word in ("demo", "bench", "config", "host DRAM"):
        assert word in proc.stdout


@pytest.mark.parametrize(("text", "field"), [
    ('{"cpu_bytes_to_use": 1048576, "prefill_tokens_per_s": Infinity}', "prefill_tokens_per_s"),
    ('{"cpu_bytes_to_use": 1048576, "prefill_tokens_per_s": NaN}', "prefill_tokens_per_s"),
    ('{"cpu_bytes_to_use": 1048576, "guard": {"ttft_p99_ms": 100, "window_s": Infinity}}', "guard.window_s"),
    ('{"cpu_bytes_to_use": 1048576, "guard": {"ttft_p99_ms": 100, "hold_s": 1e400}}', "guard.hold_s"),
    ('{"cpu_bytes_to_use": 1048576, "shutdown_flush_s": -Infinity}', "shutdown_flush_s"),
    ('{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "redis", "url": "redis://h:6379/0", '
     '"max_bytes": 16777216, "trusted_network": true, "socket_timeout_s": Infinity}]}',
     r"secondary_tiers\[0\].socket_timeout_s"),
    ('{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "redis", "url": "redis://h:6379/0", '
     '"max_bytes": 16777216, "trusted_network": true, "socket_timeout_s": 1e12}]}',  # past what a socket takes
     r"secondary_tiers\[0\].socket_timeout_s"),
    ('{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "redis", "url": "redis://h:6379/0", '
     '"max_bytes": 16777216, "trusted_network": true, "oom_cap_s": 1e400}]}', r"secondary_tiers\[0\].oom_cap_s"),
])
def test_numbers_that_are_not_finite_or_past_what_their_use_takes_are_refused_naming_the_field(tmp_path, text, field):
    """JSON's Infinity and NaN (Python's json reads them) passed every bound, then overflowed in every Redis call
    while the breaker stayed closed (r_config_inf.py)."""
    with pytest.raises(ConfigError, match=field):
        parse_config(text)
    path = tmp_path / "c.json"
    path.write_text(text)
    assert main(["config", str(path)]) == 2


def test_a_guard_given_apart_refuses_infinity_too():
    with pytest.raises(ConfigError, match="guard: window_s"):
        parse_guard('{"ttft_p99_ms": 100, "window_s": Infinity}')


def _float_flags(parser: argparse.ArgumentParser, path: str = "kvtier") -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _float_flags(sub, f"{path} {name}")
        elif action.type is float:
            yield f"{path} {'/'.join(action.option_strings)}"


def test_no_flag_of_the_cli_takes_a_bare_float():
    """argparse's float reads 'inf' and 'nan': every float flag goes through finite_float."""
    assert list(_float_flags(cli_parser())) == []


@pytest.mark.parametrize(("argv", "flag"), [
    (["simulate", "t.jsonl", "--tflops", "inf"], "--tflops"),
    (["analyze", "t.jsonl", "--ttft-budget-ms", "nan"], "--ttft-budget-ms"),
    (["generate", "shared", "out.jsonl", "--rate=-inf"], "--rate"),
])
def test_a_float_flag_that_is_not_finite_exits_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert f"argument {flag}: must be a finite number" in capsys.readouterr().err


def redis(url: str = "redis://cache:6379/0", **extra) -> dict:
    return {"type": "redis", "url": url, "max_bytes": 1 << 30, **extra}


def test_a_redis_tier_without_a_key_is_refused_unless_its_network_is_trusted(tmp_path, monkeypatch, capsys):
    """Without auth_key_env, anyone who can write to the Redis plants a block every engine serves (r_redis_plant.py);
    nothing at startup said so. Now the config must choose: a key, or trusted_network."""
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].trusted_network: a redis tier without auth_key_env"):
        parse_config({**GOOD, "secondary_tiers": [fs(tmp_path), redis()]})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**GOOD, "secondary_tiers": [redis()]}))
    assert main(["config", str(path)]) == 2
    assert "secondary_tiers[0].trusted_network" in capsys.readouterr().err
    assert parse_config({**GOOD, "secondary_tiers": [redis(trusted_network=True)]}).secondary_tiers[0].trusted_network
    monkeypatch.setenv("KVTIER_CONFIG_TEST_SECRET", "a secret of more than sixteen bytes")
    signed = parse_config({**GOOD, "auth_key_env": "KVTIER_CONFIG_TEST_SECRET", "secondary_tiers": [redis()]})
    assert not signed.secondary_tiers[0].trusted_network
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].trusted_network: Input should be a valid boolean"):
        parse_config({**GOOD, "secondary_tiers": [redis(trusted_network="maybe")]})


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://cache:notaport/0?password=S3CRET-query", "redis://cache:notaport/0?password=***"),
    ("redis:default:S3CRET-noslash@cache:6379/0", "redis:***"),
    ("redis://kv:S3CRET-pw@cache:bad/0", "redis://kv:***@cache:bad/0"),
    ("redis://S3CRET-alone@cache:bad/0", "redis://***@cache:bad/0"),
    ("redis://kv:S3CRET/with@slash@cache:bad/0", "redis://kv:***@cache:bad/0"),
    ("redis://cache:bad/0?password=S3CRET@tail", "redis://***"),  # the last @ may be the password's
    ("rediss://cache:bad/0?db=1&username=kv&password=S3CRET-tls#S3CRET",
     "rediss://cache:bad/0?db=1&username=***&password=***#***"),
])
def test_a_bad_url_is_named_without_its_credentials(url, shown):
    """Only '//user:pass@' was scrubbed: redis-py's ?password= and a url without '//' reached the message
    (r_url_secret.py)."""
    with pytest.raises(ConfigError) as err:
        parse_config({**GOOD, "secondary_tiers": [redis(url, trusted_network=True)]})
    assert "S3CRET" not in str(err.value)
    assert "secondary_tiers[0].url: " in str(err.value) and f"(got {shown!r})" in str(err.value)


def test_kvtier_config_and_the_config_object_never_show_a_password(tmp_path, capsys):
    """`kvtier config FILE` printed the url, password included (r_url_secret.py)."""
    url = "redis://kv:S3CRET-pw@cache:6379/0?password=S3CRET-q&db=0"
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**GOOD, "secondary_tiers": [redis(url, trusted_network=True)]}))
    assert main(["config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "S3CRET" not in out and json.loads(out)["secondary_tiers"][0]["url"] == \
        "redis://kv:***@cache:6379/0?password=***&db=0"
    config = parse_config(path)
    assert "S3CRET" not in repr(config) and "S3CRET" not in str(config)
    assert config.secondary_tiers[0].url == url  # the store still gets it whole
