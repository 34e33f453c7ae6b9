"""Fresh engine processes without a fresh import of vLLM each: forked from a process that imported it once.

Each scenario (`tests.vllm.scenario`, `.aborts`, `.guard`) runs its engine in a process of its own, as a served
engine does. Started with `python -m`, every such process first spends most of its life importing vLLM and
torch. This one imports them once, creates no engine and starts no work, then forks one child per scenario: the
child is as fresh as a new process (no engine, no KV, no connector, no metrics), only already imported. It runs
the scenario as `python -m MODULE ARGS...` would (same `__main__`, argv, environment, working directory, output
files, exit code) in a session of its own, so that a timeout kills it with whatever it started.

The protocol, one JSON line each way on the pipe the test holds: a request `{module, args, env, cwd, stdout,
stderr}`, then `{"pid": ...}` once the child runs and `{"rc": ...}` when it has exited.
"""

from __future__ import annotations

import json
import os
import queue
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

PRELOAD = (  # what a scenario's engine imports before its first request: the engine, the CPU worker, the model
    "vllm", "vllm.inputs", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama", "kvtier.integrations.vllm.connector", "kvtier.integrations.vllm.tiny_model",
)


class Zygote:
    """The test side: `run` is `subprocess.run([python, "-m", module, *args], ...)` for the scenarios."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.scratch = scratch
        self.log = scratch / "zygote.err"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.zygote"], cwd=root, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        self.messages: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.runs = 0
        self._expect("ready", timeout_s=300)

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: Path,
            timeout_s: float = 600) -> subprocess.CompletedProcess:
        self.runs += 1
        out, err = (self.scratch / f"run-{self.runs}.{name}" for name in ("out", "err"))
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._expect("pid", timeout_s=60)
        try:
            rc = self._expect("rc", timeout_s=timeout_s)
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            self._expect("rc", timeout_s=60)  # the killed child's: the next run's replies come next
            raise
        return subprocess.CompletedProcess([module, *args], rc, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.messages.put(json.loads(line))
        self.messages.put(None)  # the zygote exited

    def _expect(self, field: str, timeout_s: float) -> int:
        try:
            message = self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the zygote sent no {field!r} in {timeout_s} s") from None
        if message is None or field not in message:
            raise RuntimeError(f"the zygote sent {message} for {field!r}; its log ends: "
                               f"{self.log.read_text()[-2000:]}")
        return message[field]


def serve() -> None:
    """The forking side: import once, then fork a child per request, in order."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own fd: vLLM logs to stdout
    os.dup2(2, 1)
    for name in PRELOAD:
        __import__(name)
    channel.write(json.dumps({"ready": 0}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            _child(request)  # never returns
        channel.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        channel.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


def _child(request: dict) -> NoReturn:
    """`python -m MODULE ARGS...` in this (forked) process, then exit with its code."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # not the test's pipe: neither this child nor what it starts reads the next request
    os.close(devnull)
    sys.argv = [request["module"], *request["args"]]
    code: int | str | None = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # a normal exit: atexit handlers and finalizers run, as `python -m` would


if __name__ == "__main__":
    serve()
