"""`vllm serve` with kvtier's connector, from the project's venv, driven over HTTP as operators drive it: the
OpenAI API for requests, `/metrics` for kvtier's families, `vllm bench serve` as the client."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
vllm = pytest.importorskip("vllm") if os.environ.get("CI") != "true" else __import__("vllm")
ENGINE_FLAGS = ["--block-size", "128", "--num-gpu-blocks-override", "48", "--enable-prefix-caching",
                "--max-num-seqs", "4", "--enforce-eager", "--max-model-len", "4096", "--dtype", "bfloat16",
                "--enable-prompt-tokens-details"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """`kvtier tiny-model DIR`, as a user would write it."""
    path = tmp_path_factory.mktemp("served") / "tiny"
    subprocess.run([sys.executable, "-m", "kvtier.cli", "tiny-model", str(path)], check=True, capture_output=True)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve MODEL --kv-transfer-config ...` in a process of its own; the test talks to it over HTTP."""

    def __init__(self, model: str, kvtier: dict, log: Path) -> None:
        self.model, self.port, self.log_path = model, free_port(), log
        transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": kvtier}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        self.log = log.open("w")
        self.proc = subprocess.Popen([str(BIN / "vllm"), "serve", model, "--port", str(self.port), *ENGINE_FLAGS,
                                      "--kv-transfer-config", json.dumps(transfer)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "vllm serve exited:\n" + self.log_path.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError("vllm serve never became ready:\n" + self.log_path.read_text()[-4000:])

    def complete(self, prompt: str) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())

    def metrics(self, prefix: str = "kvtier_") -> dict[str, float]:
        """The samples in /metrics whose name starts with `prefix`, `name{label="v",...}` without vLLM's engine
        and model labels."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(rf"^({re.escape(prefix)}[\w:]+)(?:\{{(.*)\}})? (\S+)$", line)
            if m:
                labels = ",".join(sorted(p for p in re.findall(r'\w+="[^"]*"', m.group(2) or "")
                                         if not p.startswith(("engine=", "model_name="))))
                out[f"{m.group(1)}{{{labels}}}"] = float(m.group(3))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def text(name: str, words: int = 1800) -> str:
    from kvtier.integrations.vllm.tiny_tokenizer import pseudo_words

    vocabulary = pseudo_words(2000)
    rng = random.Random(name)
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def test_vllm_serve_with_kvtier_answers_over_http_and_exports_every_family(model_dir, tmp_path):
    version = subprocess.run([str(BIN / "vllm"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "cpu" in version.stdout, version.stderr[-2000:]
    server = Server(model_dir, {"cpu_bytes_to_use": 256 << 20, "load_policy": "always"}, tmp_path / "serve.log")
    try:
        server.wait_ready()
        before = server.metrics()  # from startup on, before any request
        assert before['kvtier_tier_enabled{tier="host"}'] == 1
        assert before['kvtier_lookup_tokens_total{source="miss"}'] == 0
        first = server.complete(text("A"))
        assert first["choices"][0]["text"] and first["usage"]["prompt_tokens"] == 1800
        for other in ("B", "C", "D"):  # 3 x 1,800 tokens push A out of the engine's 48 blocks of 128
            server.complete(text(other))
        again = server.complete(text("A"))
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
    finally:
        server.stop()
    assert "kvtier: tiers host" in (tmp_path / "serve.log").read_text()  # the startup line says what it configured
