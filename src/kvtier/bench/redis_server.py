"""A real, throwaway redis-server: a free loopback port, no persistence, a temp dir, stopped by its pid.

The one starter the Redis benchmark and the tests share. Tests kill and restart it (same port) to check
what kvtier does when the shared tier goes away and comes back.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (10,000 above) is free too: at most 55,535."""
    rng = random.Random()
    while True:
        port = rng.randrange(20_000, 55_535)
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


class RedisClusterNodes:
    """A real Redis Cluster on loopback: `primaries` primaries with `replicas` replicas each, every node a
    `RedisServer` with `--cluster-enabled yes`, joined by `redis-cli --cluster create`. Nodes can be killed,
    restarted and added one by one, as the drills need."""

    def __init__(self, binary: str, directory: Path, primaries: int = 3, replicas: int = 1,
                 extra: tuple[str, ...] = ()) -> None:
        self.binary, self.dir, self.extra = binary, directory, extra
        self.primaries, self.replicas = primaries, replicas
        self.nodes: list[RedisServer] = []

    @property
    def seed_url(self) -> str:
        return self.nodes[0].url

    def node(self, index: int | None = None) -> RedisServer:
        """A new cluster-enabled node, started (not yet a member): `index` names its folder."""
        index = len(self.nodes) if index is None else index
        for attempt in range(20):  # another process may take a port between the check and the start
            server = RedisServer(self.binary, self.dir / f"node{index}", port=cluster_port(), extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
                # replicas sync over the socket at once (no fork-to-disk), and one that lost its primary always
                # stands for election: a drill's failover takes about two node timeouts
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--cluster-replica-validity-factor", "0",
                *self.extra))
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 19:
                    raise
        self.nodes.append(server)
        return server

    def start(self, timeout_s: float = 30.0) -> RedisClusterNodes:
        for _ in range(self.primaries * (1 + self.replicas)):
            self.node()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        self.cli("--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes")
        self.wait_ok(timeout_s)
        return self

    def cli(self, *args: str) -> str:
        """`redis-cli` with these arguments; raises naming its output when it fails."""
        redis_cli = shutil.which("redis-cli") or str(Path(self.binary).with_name("redis-cli"))
        proc = subprocess.run([redis_cli, *args], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args[:2])} exited {proc.returncode}: "
                               f"{(proc.stdout + proc.stderr)[-2000:]}")
        return proc.stdout

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports `cluster_state:ok` with all 16,384 slots assigned, and every replica
        is in sync with its primary (a failover then loses only what was written since)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for n in self.nodes:
                if n.proc is None:
                    continue
                try:
                    with n.client() as c:
                        info = c.execute_command("CLUSTER", "INFO")
                        role = c.info("replication")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    synced = role["role"] != "slave" or role.get("master_link_status") == "up"
                    states.append("cluster_state:ok" in text and "cluster_slots_assigned:16384" in text and synced)
                except redis.exceptions.RedisError:
                    states.append(False)
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ok within {timeout_s} s")
            time.sleep(0.1)

    def wait_agreed(self, timeout_s: float = 30.0) -> None:
        """Until `redis-cli --cluster check` passes: every node agrees on the slots (after a reshard the new
        owner's config takes a moment to spread, and `--cluster add-node` refuses to run before)."""
        live = next(n for n in self.nodes if n.proc is not None)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.cli("--cluster", "check", f"127.0.0.1:{live.port}")
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def throwaway_redis() -> AbstractContextManager[str]:
    """A RedisServer in a temp dir for the length of a `with`; yields its URL."""
    return _throwaway(lambda binary, tmp: RedisServer(binary, tmp).start())


def throwaway_cluster() -> AbstractContextManager[str]:
    """A RedisClusterNodes (3 primaries, a replica each) in a temp dir for the length of a `with`; yields its
    seed URL."""
    return _throwaway(lambda binary, tmp: RedisClusterNodes(binary, tmp).start())


@contextmanager
def _throwaway(start: Callable[[str, Path], RedisServer | RedisClusterNodes]) -> Iterator[str]:
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvtier-redis-") as tmp:
        started = start(binary, Path(tmp))
        try:
            yield started.url if isinstance(started, RedisServer) else started.seed_url
        finally:
            started.stop()
