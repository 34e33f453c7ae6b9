"""An OpenAI-compatible server the rollout (and the tests) drive over HTTP: `vllm serve` started here with the
tiny model on this CPU, or the user's own server started from a command template.

A template is a shell command with `{port}` and `{kv_transfer_config}` (the JSON for vLLM's
`--kv-transfer-config`, shell-quoted; empty for a step without kvtier):

    vllm serve my/model --port {port} --gpu-memory-utilization 0.9 {kv_transfer_config}
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# The embedded default: vLLM's CPU backend, the tiny model, an engine cache of 48 blocks of 128 tokens.
ENGINE_FLAGS = ["--block-size", "128", "--enable-prefix-caching", "--max-num-seqs", "4", "--enforce-eager",
                "--max-model-len", "4096", "--dtype", "bfloat16", "--enable-prompt-tokens-details", "--seed", "0"]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
MAX_MODEL_LEN = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inductor_cache_dir() -> str:
    """Where torch keeps its compiled kernels by default: `torch._inductor.runtime.cache_dir_utils.default_cache_dir`,
    written out because a rollout against another machine's server needs no torch here."""
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser()))


def temp_env(folder: str) -> dict[str, str]:
    """This environment for a vLLM process whose temp files go to `folder`: it leaves some there (its processes'
    sockets, its process group's file store), even when stopped cleanly. Torch's compiled kernels stay where
    torch keeps them, for the next process to reuse."""
    return {"TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(), **os.environ, "TMPDIR": folder}


def transfer_config(kvtier: dict | None) -> dict | None:
    """vLLM's `--kv-transfer-config` for a kvtier config (its `kv_connector_extra_config`)."""
    if kvtier is None:
        return None
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": kvtier}


def embedded_command(model: str, kvtier: dict | None, engine_blocks: int, port: int) -> list[str]:
    """`vllm serve` from this environment: the CLI next to this Python."""
    transfer = transfer_config(kvtier)
    extra = [] if transfer is None else ["--kv-transfer-config", json.dumps(transfer)]
    return [str(Path(sys.executable).parent / "vllm"), "serve", model, "--port", str(port), *ENGINE_FLAGS,
            "--num-gpu-blocks-override", str(engine_blocks), *extra]


def template_command(template: str, kvtier: dict | None, port: int) -> list[str]:
    transfer = transfer_config(kvtier)
    flag = "" if transfer is None else "--kv-transfer-config " + shlex.quote(json.dumps(transfer))
    return ["/bin/sh", "-c", template.format(port=port, kv_transfer_config=flag)]


class Server:
    """One server process (its own session: a kill reaches the engine's processes too) and its log file."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 model: str | None = None) -> None:
        self.command, self.port, self.log_path, self.model = command, port, log, model
        self._scratch = tempfile.mkdtemp(prefix="kvtier-vllm-")  # removed once the server is gone
        self.env = {**temp_env(self._scratch), **ENGINE_ENV, **(env or {})}
        self.proc: subprocess.Popen | None = None
        try:
            self.start()
        except BaseException:
            self._remove_scratch()
            raise

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        os.makedirs(self._scratch, exist_ok=True)
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> float:
        """Seconds until /health answered; RuntimeError with the log's tail if the server exits or never does."""
        start = time.monotonic()
        assert self.proc is not None
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
        if self.model is None:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as r:
                self.model = json.loads(r.read())["data"][0]["id"]
        return time.monotonic() - start

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """/metrics samples whose name starts with `prefix`, as `name{label="v",...}` (labels sorted, vLLM's
        `engine` and `model_name` left out; summed over engines)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith(prefix) or sample.name.endswith("_created"):  # timestamps, not figures
                    continue
                labels = ",".join(sorted(f'{k}="{v}"' for k, v in sample.labels.items()
                                         if k not in ("engine", "model_name")))
                key = f"{sample.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def rss_bytes(self) -> int:
        """Resident memory of every process of the server (its session), now."""
        assert self.proc is not None
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == self.proc.pid:  # the process group: the server and the engine it started
                    total += int((stat.parent / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def kill(self) -> None:
        """kill -9 of the whole server (the restart drill): nothing is flushed, nothing is cleaned up."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._remove_scratch()

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM, as an orchestrator stops a server; SIGKILL if it has not exited after `timeout_s`."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        """The server is gone: so are the files it left (`start` makes their folder again)."""
        shutil.rmtree(self._scratch, ignore_errors=True)
