"""A real, throwaway redis-server: a free loopback port, no persistence, a temp dir, stopped by its pid.

The one starter the Redis benchmark and the tests share. Tests kill and restart it (same port) to check
what kvtier does when the shared tier goes away and comes back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from kvtier.rollout.server import free_port


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(
        self, binary: str, directory: Path | None = None, port: int | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        self.binary = binary
        self.dir = Path(directory or tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self._port_is_ours = port is None  # another process may grab a free port first: then we pick again
        self.extra = extra  # more `--option value` arguments, e.g. ("--maxmemory", "10mb")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start on `self.port` and wait until it answers PING."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning", *self.extra]
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                if self._port_is_ours and "Address already in use" in self.log_tail():
                    self.port = free_port()
                    return self.start(timeout_s)
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with self.client() as c:
                    if c.ping():
                        self._port_is_ours = False  # from now on the port is the server's: restarts keep it
                        return self
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING: {self.log_tail()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, no save."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: signal.Signals) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)  # a paused server could not act on SIGTERM
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets open but answers nothing (a hung or overloaded Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill, then start again on the same port (empty: nothing was persisted)."""
        self.kill()
        self.start()

    def log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-2000:]
        except OSError:
            return ""


@contextmanager
def throwaway_redis() -> Iterator[str]:
    """A RedisServer in a temp dir for the length of a `with`; yields its URL."""
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvtier-redis-") as tmp:
        server = RedisServer(binary, Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.stop()
