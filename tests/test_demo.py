"""The demo's claims, checked: tiers serve more tokens than the engine alone, and everything they serve is exact."""

from __future__ import annotations

from rich.console import Console

from kvtier.demo.in_process import run_demo


def test_demo_tiers_save_recomputation_and_stay_exact():
    results = run_demo(n_requests=60, seed=1, console=Console(file=open("/dev/null", "w")))
    engine_only, host, host_disk = results
    assert [r.name for r in results] == ["engine only", "+ host", "+ host + disk"]
    assert all(r.exact and r.mismatches == 0 for r in results)
    total = sum(engine_only.tokens.values())
    assert all(sum(r.tokens.values()) == total for r in results)  # every prompt token is accounted once
    assert host.tokens["host"] > 0 and host_disk.tokens["disk"] > 0
    assert host.tokens["recomputed"] < engine_only.tokens["recomputed"]
    assert host_disk.tokens["recomputed"] < host.tokens["recomputed"]
    for r in (host, host_disk):
        assert r.snapshot["orphan_blocks"] == 0
        for tier in r.snapshot["tiers"].values():
            assert tier["used_bytes"] <= tier["capacity_bytes"]
