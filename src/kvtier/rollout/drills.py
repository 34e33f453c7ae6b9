"""Step 6's drills for the secondary tier, and step 7's drill that breaks the budget.

Before them, a fill phase (new unique prompts of a host tier and a quarter) has the host tier let the last level's
prefixes go to disk: the drills find them there, as a tier's prefixes are after a change of traffic. (A fill of
reused prompts, or of more, would have the disk let them go too: it is sized for the levels' reuse.)
- promotion burst: every reused prefix of the last level at once, most of them on disk only;
- storage pressure: the tier's file system full (injected: `kvtier.rollout.faults`) while new prefixes arrive;
  writes must fail as dropped stores, never as failed requests;
- restart: kill -9 of the whole server, then the same configuration again: what the disk tier kept comes back;
- cache loss: every file of the tier deleted under the running server: its blocks become misses, recomputed.
A drill passes when no request failed and its own check holds. The rollback drill slows every disk read
(injected) in a server that must load whatever the disk has (`load_policy: always`; its disk admits every block
host evicts), until the guard turns the disk off, then heals it until the guard has it back.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from typing import Any

from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCK_TOKENS, ENGINE_BLOCKS
from kvtier.rollout import client, faults
from kvtier.rollout.harness import Rollout
from kvtier.rollout.server import Server
from kvtier.rollout.sizes import BLOCK_TOKENS
from kvtier.rollout.workload import QUESTION_TOKENS, REUSE_TOKENS, UNIQUE_TOKENS, VOCAB

DISK_ENABLED = 'kvtier_tier_enabled{tier="disk"}'
FILL_HOSTS = 1.25  # the fill phase: new unique prompts of 1.25 host tiers (the host is not an exact LRU)
STORAGE_REQUESTS = 20  # new prompts while the disk is full: the host tier evicts, its writes to disk fail


def prefixes(ro: Rollout) -> list[client.Prompt]:
    """The last level's reused prompts, one for each prefix they reuse (a prompt less its own last
    QUESTION_TOKENS): what the levels stored last, and by the drills' fill, on disk."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in ro.workload(ro.opts.loads):
        key = tuple(p.tokens[: max(REUSE_TOKENS, len(p.tokens) - QUESTION_TOKENS)])
        if p.reused and key not in seen:
            seen.add(key)
            out.append(p)
    return out


def fill(ro: Rollout, salt: int) -> list[client.Prompt]:
    """New prompts that share nothing (random tokens) holding FILL_HOSTS times the host tier's bytes: after them the
    host tier holds none of the last level's prefixes, and the disk has let go only its oldest blocks."""
    assert ro.sizes is not None
    need = FILL_HOSTS * ro.sizes.host_bytes * BLOCK_TOKENS / ro.sizes.block_bytes  # tokens
    rng = random.Random(f"fill/{ro.opts.seed}/{salt}")
    return [client.Prompt([rng.randrange(3, VOCAB) for _ in range(UNIQUE_TOKENS)], "fill", 2)
            for _ in range(math.ceil(need / UNIQUE_TOKENS))]


def secondary(ro: Rollout, server: Server, step: str) -> list[dict]:
    """The secondary tier's drills. A fill phase (`fill`) has the host tier let the last level's prefixes go, so
    that most are on disk only."""
    ro.measure(server, "drills: filling the host tier", fill(ro, 201))
    drills = []
    every = prefixes(ro)
    burst = ro.measure(server, "drill: promotion burst", every, client.Load(clients=len(every)))
    drills.append(outcome("promotion burst", burst, f"every reused prefix of the last level ({len(every)}) at once",
                          burst["tokens"]["disk"] > 0, "the disk served part of the burst"))

    faults.set_full(ro.root, True)  # new prefixes, enough for the host tier to evict: its writes to disk fail
    try:
        full = ro.measure(server, "drill: storage pressure", ro.workload(101)[:STORAGE_REQUESTS])
    finally:
        faults.set_full(ro.root, False)
    failed = full["kvtier"].get('kvtier_stores_dropped_total{reason="disk_failed"}', 0)
    drills.append(outcome("storage pressure", full, "disk writes fail with ENOSPC (injected)", failed > 0,
                          f"{failed:.0f} stores dropped as disk_failed, requests unaffected", injected=True))

    server.kill()
    server.start()
    ready_s = ro.ready(server, "drill: restart")
    restarted = ro.measure(server, "drill: restart", every)
    drills.append(outcome("restart", restarted, "kill -9 of the server, then the same configuration",
                          restarted["tokens"]["disk"] > 0, f"ready again after {ready_s:.0f} s; the prefixes came "
                          "back from disk"))

    ro.measure(server, "drills: filling the host tier again", fill(ro, 301))  # the prefixes on disk only again
    root = ro.disk_root(step)
    files = sum(1 for _ in root.rglob("*.kv"))
    for entry in root.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    lost = ro.measure(server, "drill: cache loss", every)
    gone = lost["kvtier"].get('kvtier_evictions_total{reason="lost",tier="disk"}', 0)
    drills.append({**outcome("cache loss", lost, f"every file of the disk tier ({files} under {root}) deleted under "
                             "the running server", gone > 0, f"{gone:.0f} blocks found gone when read: recomputed, "
                             "every request answered"), "files_deleted": files, "root_dir": str(root)})
    return drills


def outcome(name: str, summary: dict, what: str, check: bool, meaning: str, injected: bool = False) -> dict:
    passed = check and summary["errors"] == 0
    return {**summary, "drill": name, "what": what, "injected": injected, "passed": passed,
            "outcome": meaning if passed else f"FAILED: {meaning} did not hold ({summary['errors']} errors)"}


def rollback(ro: Rollout, server: Server, budget_ms: float) -> dict:
    """Slow disk reads past the budget until the guard turns the disk off, then heal them until it is back.

    Each prompt's prefix is one kvtier block, so a request that reads the disk waits for one slowed read: its
    TTFT is just over the budget, and the guard's windows (`Rollout.guard`) hold two such requests."""
    assert ro.sizes is not None
    rng = random.Random(ro.opts.seed)
    count = ro.sizes.host_bytes // ro.sizes.block_bytes + ENGINE_BLOCKS * ENGINE_BLOCK_TOKENS // BLOCK_TOKENS + 8
    prompts = [client.Prompt([rng.randrange(3, VOCAB) for _ in range(BLOCK_TOKENS + 64)], "rollback", 2)
               for _ in range(count)]  # more than the engine's cache and the host tier hold: the disk has the rest
    stored = ro.measure(server, f"rollback: store {count} prefixes", prompts)
    delay = max(0.3, budget_ms / 1e3)
    guard = ro.guard("rollback") or {}
    limit_s = max(40.0, 4 * guard.get("window_s", 5.0) + guard.get("hold_s", 0.0))
    faults.set_read_delay(ro.root, delay)
    start, timeline = time.monotonic(), list[dict[str, Any]]()
    phases = [("slow", lambda on: not on, 4.0), ("healed", lambda on: on, 0.0)]
    try:
        for phase, done, then_s in phases:
            if phase == "healed":
                faults.set_read_delay(ro.root, 0)
            began, reached, i = time.monotonic(), None, 0
            while time.monotonic() - began < limit_s:
                result = client.send(server.url, server.model or "", [prompts[i % len(prompts)]])[0]
                on = server.metrics("kvtier_tier_enabled").get(DISK_ENABLED, 1.0) == 1.0
                timeline.append({"t": time.monotonic() - start, "phase": phase, "ttft_ms": 1e3 * result.ttft,
                                 "error": result.error, "disk_enabled": on})
                i += 1
                if reached is None and done(on):
                    reached = time.monotonic()
                if reached is not None and time.monotonic() - reached >= then_s:
                    break
    finally:
        faults.set_read_delay(ro.root, 0)
    after = server.metrics("kvtier_guard_transitions")
    off_at = next((e["t"] for e in timeline if not e["disk_enabled"]), None)
    back_at = next((e["t"] for e in timeline if e["phase"] == "healed" and e["disk_enabled"]), None)
    host_changed = sum(v for k, v in after.items() if 'tier="host"' in k)
    passed = off_at is not None and back_at is not None and not host_changed and not any(e["error"] for e in timeline)
    outcome = (f"FAILED: the guard did not turn the disk off and back on within {limit_s:.0f} s each, or turned "
               "the host off")
    if passed and off_at is not None and back_at is not None:
        outcome = f"the guard turned the disk off after {off_at:.0f} s and back on {back_at - off_at:.0f} s later"
    what = (f"every disk read sleeps {delay:.2f} s (injected), load_policy always, the disk admits every block "
            f"host evicts; budget {budget_ms:,.0f} ms, guard windows of {guard.get('window_s', 0):.0f} s")
    return {"drill": "slow disk", "what": what, "budget_ms": budget_ms, "window_s": guard.get("window_s"),
            "injected": True, "stored": stored["tokens"], "timeline": timeline, "off_after_s": off_at,
            "back_after_s": back_at, "guard_transitions": after, "passed": passed, "outcome": outcome}
