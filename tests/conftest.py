"""Shared fixtures: real files in a temp dir, small block shapes, configs built the way users write them."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvtier.config import parse_config
from kvtier.digests import CACHE_ENV
from kvtier.traces.locate import ENV

SHAPE = (2, 2, 4, 16, 64)  # layers, K/V, heads, tokens, head dim: 16 KiB in bf16, 32 KiB in fp32


def public_traces() -> Path:
    """The public traces' folder (`kvtier.traces.locate`): $KVTIER_TRACES_DIR, else a `shared/traces` folder beside
    the repository or above it, as this project's workspace lays them out; exported, so that the code under test
    finds it too. Where neither exists, the tests that read a trace fail naming the folder they looked in."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    repo = Path(__file__).resolve().parents[1]
    found = next((p / "shared" / "traces" for p in (repo, *repo.parents) if (p / "shared" / "traces").is_dir()), None)
    if found is None:
        return repo.parent / "shared" / "traces"
    os.environ[ENV] = str(found)
    return found


PUBLIC_TRACES = public_traces()


@pytest.fixture
def shape() -> tuple[int, ...]:
    return SHAPE


def missing(part: str) -> None:
    """A part the test needs is missing: a skip on a laptop, a failure in CI (`CI=true`), where `make test`
    provides every part (root, redis-server)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(part)
    pytest.skip(part)


# A redis tier needs auth_key_env or "trusted_network": true. Tests sign their blocks with this secret (an engine
# of another test's deployment, or a test's stand-in for another engine of the same one, passes its key too).
REDIS_SECRET_ENV = "KVTIER_TEST_REDIS_SECRET"
os.environ.setdefault(REDIS_SECRET_ENV, "the tests' shared secret, 32+ bytes")
SIGNED = {"auth_key_env": REDIS_SECRET_ENV}


# The disk tests test the disk path, not its admission: every block that host evicts goes down (the default,
# `min_sightings: auto`, demotes first sightings only once blocks are seen coming back).
DEMOTE_ALL = {"admission": {"min_sightings": 1}}


def make_config(tmp_path, host_blocks: int, disk_blocks: int | None = None, dtype=torch.bfloat16, **disk_extra):
    block = 1
    for d in SHAPE:
        block *= d
    block *= dtype.itemsize
    data = {"cpu_bytes_to_use": host_blocks * block, "block_size": 16}
    if disk_blocks is not None:
        data["secondary_tiers"] = [
            {"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": disk_blocks * (block + 4096),
             **DEMOTE_ALL, **disk_extra}
        ]
    return parse_config(data)


def random_blocks(n: int, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(dtype) for _ in range(n)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def native_threads_beyond_python() -> int:
    """Threads of this process that Python did not start (OpenMP's workers among them), once threads that are
    still exiting (a Python thread leaves `threading.enumerate()` before its native thread ends) are gone."""
    def count() -> int:
        return len(os.listdir("/proc/self/task")) - len(threading.enumerate())

    last = count()
    for _ in range(40):
        time.sleep(0.05)
        if (now := count()) == last:
            return now
        last = now
    return last


@contextmanager
def torch_kernel_in_a_thread() -> Iterator[None]:
    """A thread that ran a torch kernel (so started an OpenMP team of its own), alive until the block ends: what
    `native_threads_beyond_python` must see for a test of "no team" to mean anything."""
    started, finish = threading.Event(), threading.Event()

    def kernel_then_wait() -> None:
        torch.ones(1 << 22).add_(1)
        started.set()
        finish.wait(10)

    prober = threading.Thread(target=kernel_then_wait)
    prober.start()
    started.wait(10)
    try:
        yield
    finally:
        finish.set()
        prober.join()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, stopped (by pid) after the test. Missing binary: a skip
    on a laptop, a failure in CI (`CI=true`), where `make test` installs it."""
    from tests.redis_server import RedisServer, redis_server_binary

    binary = redis_server_binary()
    if binary is None:
        missing("redis-server is not installed (make venv installs it: apt-get install redis-server)")
    server = RedisServer(binary, tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    """A real Redis Cluster: six redis-server nodes with `--cluster-enabled yes` on free loopback ports, joined by
    `redis-cli --cluster create … --cluster-replicas 1` (three primaries, a replica each); stopped after."""
    from kvtier.bench.redis_server import RedisClusterNodes, redis_server_binary

    binary = redis_server_binary()
    if binary is None:
        missing("redis-server is not installed (make venv installs it: apt-get install redis-server)")
    cluster = RedisClusterNodes(binary, tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session", autouse=True)
def contained_temp_files(tmp_path_factory) -> None:
    """vLLM leaves files in the temp folder (its processes' sockets, its process group's file store): this run's
    own folder instead of /tmp, for this process and every process it starts. Torch's compiled kernels stay where
    torch keeps them, for later runs to reuse."""
    from kvtier.rollout.server import inductor_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    folder = str(tmp_path_factory.mktemp("temp"))
    os.environ["TMPDIR"] = tempfile.tempdir = folder  # vLLM's sockets go to the temp folder unless told otherwise
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("kvtier-cache"))  # weight files' digests: not the user's


@pytest.fixture(scope="session")
def served_model(tmp_path_factory) -> str:
    """`kvtier tiny-model DIR`, as a user would write it: weights, a tokenizer, a chat template."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("served") / "tiny"
    subprocess.run([sys.executable, "-m", "kvtier.cli", "tiny-model", str(path)], check=True, capture_output=True)
    return str(path)
