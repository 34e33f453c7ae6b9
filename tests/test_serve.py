"""`vllm serve` with kvtier's connector, from the project's venv, driven over HTTP as operators drive it: the
OpenAI API for requests, `/metrics` for kvtier's families, `vllm bench serve` as the client."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCKS
from kvtier.rollout.server import Server, embedded_command, free_port

BIN = Path(sys.executable).parent
vllm = pytest.importorskip("vllm") if os.environ.get("CI") != "true" else __import__("vllm")


@pytest.fixture
def model_dir(served_model) -> str:
    return served_model


def serve(model: str, kvtier: dict, log: Path, flags: list[str]) -> Server:
    """`vllm serve MODEL --kv-transfer-config ...` (the rollout's embedded command) in a process of its own."""
    port = free_port()
    server = Server(embedded_command(model, kvtier, ENGINE_BLOCKS, port) + flags, port, log, model=model)
    try:
        server.wait_ready(240)
    except BaseException:
        server.kill()
        raise
    return server


def complete(server: Server, prompt: str, **extra) -> dict:
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


class KVEventsSubscriber:
    """What a KV-aware router reads: vLLM's KV event batches over ZMQ, from the address vLLM binds."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")

    def stored(self) -> dict[str, list]:
        """Every BlockStored received so far, by medium."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        decoder, out = msgspec.msgpack.Decoder(type=KVEventBatch), {}
        while self.socket.poll(2000, zmq.POLLIN):
            _topic, _seq, payload = self.socket.recv_multipart()
            for event in decoder.decode(payload).events:
                if isinstance(event, BlockStored):
                    out.setdefault(event.medium, []).append(event)
        return out

    def close(self) -> None:
        self.socket.close(linger=0)


def text(name: str, words: int = 1800) -> str:
    from kvtier.integrations.vllm.tiny_tokenizer import pseudo_words

    vocabulary = pseudo_words(2000)
    rng = random.Random(name)
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def test_vllm_serve_with_kvtier_answers_over_http_and_exports_every_family(model_dir, tmp_path):
    version = subprocess.run([str(BIN / "vllm"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "cpu" in version.stdout, version.stderr[-2000:]
    events = free_port()
    flags = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                               "endpoint": f"tcp://*:{events}"})]
    server = serve(model_dir, {"cpu_bytes_to_use": 256 << 20, "load_policy": "always"}, tmp_path / "serve.log", flags)
    subscriber = KVEventsSubscriber(f"tcp://127.0.0.1:{events}")
    try:
        time.sleep(0.5)  # subscribed before the first event
        before = server.metrics()  # from startup on, before any request
        assert before['kvtier_tier_enabled{tier="host"}'] == 1
        assert before['kvtier_lookup_tokens_total{source="miss"}'] == 0
        first = complete(server, text("A"))
        assert first["choices"][0]["text"] and first["usage"]["prompt_tokens"] == 1800
        for other in ("B", "C", "D"):  # 3 x 1,800 tokens push A out of the engine's 48 blocks of 128
            complete(server, text(other))
        again = complete(server, text("A"))
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1536, again["usage"]  # from the host tier
        time.sleep(1)
        m = server.metrics()
        served = m['kvtier_lookup_tokens_total{source="host"}'] + m['kvtier_lookup_tokens_total{source="engine"}']
        assert m['kvtier_lookup_tokens_total{source="host"}'] > 0 and served >= 1536, m  # what vLLM still held + host
        assert m['kvtier_lookup_tokens_total{source="miss"}'] > 0
        assert m['kvtier_tier_enabled{tier="host"}'] == 1
        by_source = server.metrics("vllm:prompt_tokens_cached_by_source")  # vLLM's own counter knows the tier
        assert by_source['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == \
            m['kvtier_lookup_tokens_total{source="host"}'], by_source
        for pair in ('dst="caller",src="host"', 'dst="host",src="caller"'):  # every move timed, in vLLM's registry
            assert m[f"kvtier_move_seconds_count{{{pair}}}"] == m[f"kvtier_moves_total{{{pair}}}"] > 0, pair
        bench = subprocess.run(
            [str(BIN / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", server.url, "--model", model_dir,
             "--tokenizer", model_dir, "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
             "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "2",
             "--prefix-repetition-output-len", "4", "--num-prompts", "8", "--max-concurrency", "2"],
            capture_output=True, text=True, timeout=600)
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        assert re.search(r"Successful requests:\s+8", bench.stdout), bench.stdout[-3000:]
        stored = subscriber.stored()
    finally:
        subscriber.close()
        server.stop()
    # KV-aware routers see the host tier's blocks: under vLLM's own block hashes, with their tokens
    ours, engine = stored.get("CPU", []), {h for e in stored.get("GPU", []) for h in e.block_hashes}
    assert ours and all(e.block_size == 128 and len(e.token_ids) == 128 * len(e.block_hashes) > 0 for e in ours)
    assert {h for e in ours for h in e.block_hashes} <= engine, "the hashes vLLM announced for its own blocks"
    assert "kvtier: tiers host" in (tmp_path / "serve.log").read_text()  # the startup line says what it configured


def test_a_graceful_stop_writes_the_host_tier_to_disk_and_the_restarted_server_serves_it(model_dir, tmp_path):
    """write_back: blocks reach the disk only when the host evicts them, so a big host tier holds them all. A
    stop that gives vLLM time (`--shutdown-timeout`) runs the connector's shutdown, which writes them to disk;
    the next server recovers them and serves the prompt from disk."""
    root = tmp_path / "kv"
    config = {"cpu_bytes_to_use": 64 << 20, "block_size": 256, "load_policy": "always",
              "secondary_tiers": [{"type": "fs", "root_dir": str(root), "max_bytes": 64 << 20}]}
    server = serve(model_dir, config, tmp_path / "first.log", ["--shutdown-timeout", "30"])
    try:
        first = [complete(server, text(name)) for name in "ABCD"]
        stored = 'kvtier_moves_total{dst="host",src="caller"}'
        for _ in range(20):  # D's stores ship with the engine's next step: a short request makes one
            complete(server, text("tail", words=8))
            if server.metrics().get(stored, 0) >= 4 * (1800 // 256):
                break
            time.sleep(0.5)
        assert not list(root.rglob("*.kv")), "write_back: nothing evicted from host, nothing on disk yet"
    finally:
        server.stop()
    log = (tmp_path / "first.log").read_text()
    flushed = re.search(r"kvtier: shutdown: (\d+) of the host tier's (\d+) blocks written to disk", log)
    assert flushed and flushed.group(1) == flushed.group(2) == str(len(list(root.rglob("*.kv")))), log[-3000:]
    assert int(flushed.group(1)) == 4 * (1800 // 256)  # every full block of the four prompts
    server = serve(model_dir, config, tmp_path / "second.log", [])
    try:
        again = complete(server, text("A"))
        m = server.metrics()
    finally:
        server.stop()
    assert f"disk 64 MiB (127 blocks, lru, {flushed.group(1)} recovered)" in (tmp_path / "second.log").read_text()
    assert m['kvtier_lookup_tokens_total{source="disk"}'] >= 1536 and again["choices"] == first[0]["choices"]


def chat(server: Server, messages: list[dict]) -> dict:
    body = json.dumps({"model": server.model, "messages": messages, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def test_chat_users_that_differ_only_in_their_text_share_the_prefix_cache_only_where_their_texts_do(model_dir,
                                                                                                      tmp_path):
    """A multi-turn chat client sends text, not ids: every user's prompt must be its own tokens, so that vLLM's
    prefix cache (no connector here) hits a user's own earlier turns, and another user's only as far as the two
    texts are the same."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    system = {"role": "system", "content": "You answer questions about the quarterly report. " * 8}
    users = {n: [system, {"role": "user", "content": f"For user {n}, here are some other context: hi hi hi. " * 4}]
             for n in (1, 2)}
    ids = {n: tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False) for n, m in users.items()}
    shared = next(i for i, (a, b) in enumerate(zip(ids[1], ids[2])) if a != b)
    assert 128 <= shared < len(ids[1]) - 128  # the system message's blocks are shared, the users' own are not
    server = serve(model_dir, None, tmp_path / "chat.log", [])
    try:
        first = chat(server, users[1])
        other = chat(server, users[2])
        users[1] += [first["choices"][0]["message"], {"role": "user", "content": "And the next quarter?"}]
        again = chat(server, users[1])
    finally:
        server.stop()
    assert first["usage"]["prompt_tokens"] == len(ids[1]) and other["usage"]["prompt_tokens"] == len(ids[2])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // 128 * 128
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids[1]) // 128 * 128


def test_two_servers_share_a_prefix_through_a_redis_cluster(model_dir, tmp_path, redis_cluster):
    """Two `vllm serve` on one real 6-node Redis Cluster: the second serves the prompt the first stored from the
    cluster, and its answer (tokens and logprobs) is bit-identical to its own engine cache hit of the prompt."""
    tier = {"type": "redis", "url": redis_cluster.seed_url, "cluster": True, "max_bytes": 1 << 30,
            "trusted_network": True, "lookup_deadline_s": 10}
    config = {"cpu_bytes_to_use": 256 << 20, "load_policy": "always", "secondary_tiers": [tier]}
    first = serve(model_dir, config, tmp_path / "first.log", [])
    try:
        complete(first, text("A"))
        written = 'kvtier_moves_total{dst="redis",src="host"}'
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # A's stores ship with the engine's next step, which A again makes: an engine hit whose store offers
            # A's blocks to the cluster again, so that a write-through a node's hiccup dropped is sent once more
            complete(first, text("A"))
            if first.metrics().get(written, 0) >= 1800 // 128:
                break
            time.sleep(0.5)
        kvtier = {k: v for k, v in first.metrics("kvtier_").items() if v and "_bucket" not in k}
        assert kvtier.get(written, 0) >= 1800 // 128, f"{kvtier}\n{first.log_tail()}"
    finally:
        first.stop()
    second = serve(model_dir, config, tmp_path / "second.log", [])
    try:
        from_cluster = complete(second, text("A"), logprobs=5)
        m = second.metrics()
        engine_hit = complete(second, text("A"), logprobs=5)  # now in its own engine cache
    finally:
        second.stop()
    assert from_cluster["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1536, from_cluster["usage"]
    assert m['kvtier_lookup_tokens_total{source="redis"}'] >= 1536
    assert engine_hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1536
    assert from_cluster["choices"] == engine_hit["choices"], "bit-identical to the engine's own hit"
