"""`kvtier calibrate` against a real `vllm serve` (the tiny model on this CPU) and real host, disk and Redis tiers:
the profile it writes loads back, each fit reproduces its own points, and the points say what the engine does."""

from __future__ import annotations

import os

import pytest

from kvtier.calibrate.calibrate import DECODE_BATCHES
from kvtier.cli.main import main
from kvtier.rollout.server import Server, embedded_command, free_port
from kvtier.sim.profile import MAX_RELATIVE_RMS, load_profile

vllm = pytest.importorskip("vllm") if os.environ.get("CI") != "true" else __import__("vllm")

TINY_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # layers, K and V, KV heads, head dim, bf16
ITL = "vllm:inter_token_latency_seconds"  # vLLM's histogram of the gaps between a request's tokens, engine-side


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    """The rollout's embedded `vllm serve` of the tiny model: the engine a user of the demo calibrates."""
    from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCKS

    port = free_port()
    log = tmp_path_factory.mktemp("calibrate") / "server.log"
    started = Server(embedded_command(served_model, None, ENGINE_BLOCKS, port), port, log, model=served_model)
    try:
        started.wait_ready(240)
        yield started
    finally:
        started.stop()


def test_a_calibration_through_the_cli_measures_the_server_and_every_tier(server, redis_server, tmp_path, capsys):
    out, disk = tmp_path / "profile.json", tmp_path / "disk"
    itl_before = server.metrics(ITL)
    code = main(["calibrate", "--url", server.url, "--model", server.model, "--out", str(out), "--disk-root",
                 str(disk), "--redis", redis_server.url])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "load from redis" in printed.out and str(out) in printed.out
    profile = load_profile(out)  # checks every fit against its points too

    assert profile.server["url"] == server.url and profile.server["model"] == server.model
    assert profile.server["block_size"] == 128 and profile.server["max_model_len"] == 4096
    assert profile.server["vllm_version"] and profile.server["kv_bytes_per_token"] == TINY_KV_BYTES_PER_TOKEN
    assert profile.machine["cores"] == os.cpu_count()

    prefill = profile.prefill
    residuals = [(prefill.seconds(n, c) - s) / s for n, c, s in prefill.points]
    assert (sum(r * r for r in residuals) / len(residuals)) ** 0.5 == pytest.approx(prefill.relative_rms)
    assert prefill.relative_rms <= MAX_RELATIVE_RMS
    assert prefill.seconds(2048) > prefill.seconds(64) > 0
    uncached = {n: s for n, c, s in prefill.points if c == 0}
    cached = [(n, c, s) for n, c, s in prefill.points if c > 0]
    assert len(uncached) >= 5 and min(uncached) <= 64 and len(cached) >= 2
    for n, c, _ in cached:  # the server counted whole blocks cached; the fit prices the whole prompt higher
        assert c % 128 == 0 and n + c in uncached
        assert prefill.seconds(n, c) < prefill.seconds(n + c), (n, c, prefill)
    # measured: three quarters cached saves most of the linear work, well beyond this CPU's run-to-run noise (a
    # quarter cached saves so little that a busy machine can measure it dearer than the whole prompt)
    n, c, s = max(cached, key=lambda point: point[1])
    assert s < uncached[n + c], (n, c, s, uncached)

    assert [b for b, _ in profile.decode.points] == [1.0, 2.0, 4.0]
    assert all(s > 0 for _, s in profile.decode.points) and profile.decode.relative_rms <= MAX_RELATIVE_RMS
    # what the engine itself says of the decode requests: vLLM's inter-token latencies, from its own timestamps
    # of each token (the calibration's other requests generate one token and have none); a stream read in
    # bursts cannot fool it. Requests of 32 tokens (31 gaps each) in batches of 1, 2 and 4, measured once or again
    requests = sum(DECODE_BATCHES)
    itl = {k: v - itl_before.get(k, 0.0) for k, v in server.metrics(ITL).items()}
    gaps, seconds = itl[f"{ITL}_count{{}}"], itl[f"{ITL}_sum{{}}"]
    assert gaps > 0 and gaps % (requests * 31) == 0, itl
    measured = sum(b * s for b, s in profile.decode.points) / requests
    assert measured == pytest.approx(seconds / gaps, rel=0.3), (profile.decode.points, seconds / gaps)

    assert set(profile.tiers) == {"host", "disk", "redis"} and profile.store is not None
    block = 128 * TINY_KV_BYTES_PER_TOKEN
    for name, fit in [*profile.tiers.items(), ("store", profile.store)]:
        assert 0 < fit.bytes_per_s < float("inf"), name
        assert [b for b, _ in fit.points] == [k * block for k in (1, 4, 16, 64)], name
        assert fit.relative_rms <= MAX_RELATIVE_RMS, name
    assert list(disk.iterdir()) == []  # its temp folder removed
    with redis_server.client() as client:
        assert client.dbsize() == 0  # its keys deleted


def test_decode_is_the_engines_own_time_per_output_token(server):
    """A decode point is vLLM's TPOT of the batch's requests as the engine timed them (`TPOT` on /metrics), not
    the stream's spans as this client read them: the mean of the two requests' TPOTs, to the float. The
    measurement's warm-up requests make one token each, a TPOT of 0."""
    from kvtier.calibrate.server import TPOT, measure_decode

    before = server.metrics(TPOT)
    [(batch, seconds)] = measure_decode(server.url, server.model, batches=(2,), tokens=8)
    after = server.metrics(TPOT)
    total = after[f"{TPOT}_sum{{}}"] - before.get(f"{TPOT}_sum{{}}", 0.0)
    assert batch == 2 and seconds > 0
    assert seconds == pytest.approx(total / 2, rel=1e-9), (seconds, total)


def test_a_server_that_does_not_answer_exits_2_naming_its_url(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["calibrate", "--url", url, "--out", str(tmp_path / "profile.json")]) == 2
    assert url in capsys.readouterr().err
    assert not (tmp_path / "profile.json").exists()


@pytest.mark.parametrize(("flags", "named"), [
    (["--repeats", "0"], "--repeats"),
    (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
    (["--url", "127.0.0.1:8000"], "--url"),
    (["--url", "http://127.0.0.1:1", "--redis", "http://127.0.0.1:6379"], "--redis"),
    (["--model", "no-such-folder"], "--model"),
])
def test_bad_flags_exit_2_naming_them_before_anything_starts(flags: list[str], named: str, capsys):
    assert main(["calibrate", *flags]) == 2
    assert named in capsys.readouterr().err

