"""Keys name a block and its whole prefix; namespaces separate incompatible bytes."""

from __future__ import annotations

from kvtier import FORMAT_VERSION
from kvtier.keys import ROOT_KEY, Namespace, chain_keys, precomputed_keys


def test_chain_keys_depend_on_the_whole_prefix():
    a = chain_keys(list(range(64)), 16)
    b = chain_keys([99] + list(range(1, 64)), 16)
    assert len(a) == 4 and len(set(a)) == 4
    assert all(x != y for x, y in zip(a, b))  # one token changed in block 0 changes every later key
    assert chain_keys(list(range(70)), 16) == a  # a partial trailing block has no key
    assert chain_keys(list(range(32, 64)), 16, parent=a[1]) == a[2:]  # continuing a chain


def test_extra_keys_isolate_tenants():
    tokens = list(range(32))
    assert chain_keys(tokens, 16, extra_keys=["tenant-a"]) != chain_keys(tokens, 16, extra_keys=["tenant-b"])
    assert chain_keys(tokens, 16, extra_keys=[]) == chain_keys(tokens, 16)
    assert ROOT_KEY == bytes(32)


def test_precomputed_keys_are_not_rehashed():
    hashes = [b"\x01" * 32, b"\x02" * 32]
    assert precomputed_keys(hashes) == hashes
    assert precomputed_keys(hashes, group=1) == [h + b"\x00\x01" for h in hashes]
    assert precomputed_keys([5]) == [(5).to_bytes(16, "big")]


def test_namespace_digest_covers_every_field():
    base = Namespace(model="m", dtype="bfloat16", block_size=256)
    variants = [
        Namespace(model="m2", dtype="bfloat16", block_size=256),
        Namespace(model="m", dtype="float16", block_size=256),
        Namespace(model="m", dtype="bfloat16", block_size=128),
        Namespace(model="m", dtype="bfloat16", block_size=256, rank=1),
        Namespace(model="m", dtype="bfloat16", block_size=256, world_size=2),
        Namespace(model="m", dtype="bfloat16", block_size=256, tenant_salt="t"),
        Namespace(model="m", dtype="bfloat16", block_size=256, kv_layout="HND"),
        Namespace(model="m", dtype="bfloat16", block_size=256, hash_algo="sha256_cbor"),
        Namespace(model="m", dtype="bfloat16", block_size=256, auth="0123456789abcdef"),
        Namespace(model="m", dtype="bfloat16", block_size=256, format_version=FORMAT_VERSION + 1),
    ]
    digests = {base.digest()} | {v.digest() for v in variants}
    assert len(digests) == 1 + len(variants)
    assert len(base.digest()) == 32 and base.digest() == Namespace("m", "bfloat16", 256).digest()


def test_metadata_plane_imports_neither_torch_nor_vllm():
    import subprocess
    import sys

    code = ("import sys; import kvtier.directory, kvtier.policies, kvtier.sim.instant_mover, kvtier.sizing, "
            "kvtier.config, kvtier.keys, kvtier.layout, kvtier.admission, kvtier.traces.workloads, kvtier.guard, "
            "kvtier.decide, kvtier.control, kvtier.sim.simulate, kvtier.weights, kvtier.digests; "
            "print('torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
