"""`lookup_keys_per_s`: Directory.lookup of a fully cached 128k-token prompt (16- and 256-token blocks) in a
warm directory of 1M blocks; a Python loop of dict.get over the same keys is the baseline.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from functools import partial

from kvtier.directory import Directory, TierSpec
from kvtier.keys import chain_keys
from kvtier.layout import ALIGN
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores.base import TierKind
from kvtier.timing import alternate, fresh_keys, summary


def lookup_case(
    n_blocks: int, prompt_tokens: int, reps: int, built: Callable[[], None], tick: Callable[[], None]
) -> dict:
    """A directory of `n_blocks` that holds the prompt's chains at both block sizes; time lookups of them."""
    tokens = list(range(prompt_tokens))
    prompts = {16: chain_keys(tokens, 16), 256: chain_keys(tokens, 256)}
    directory = Directory([TierSpec("host", n_blocks * ALIGN, ALIGN, kind=TierKind.HOST)])
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit does; a build of a million objects otherwise spends most of its time in gc
    try:
        start = time.perf_counter()
        for keys in prompts.values():
            complete_instantly(directory, directory.plan_store(keys))
        chain = 8192
        while (missing := n_blocks - len(directory)) > 0:
            complete_instantly(directory, directory.plan_store(fresh_keys(min(chain, missing))))
        build_s = time.perf_counter() - start
        built()
        if len(directory) != n_blocks or any(len(directory.lookup(k)) != len(k) for k in prompts.values()):
            raise RuntimeError("lookup bench: the directory does not hold the prompt's whole chain")
        table = dict(directory.blocks())  # the baseline: dict.get over the same keys in a dict of the same blocks

        def per_call(fn: Callable[[list[bytes]], object], keys: list[bytes]) -> float:
            rounds = max(1, math.ceil(65536 / len(keys)))
            start = time.perf_counter()
            for _ in range(rounds):
                fn(keys)
            return (time.perf_counter() - start) / rounds

        def dict_loop(keys: list[bytes]) -> None:
            get = table.get
            for key in keys:
                get(key)

        by_size = {}
        for block_tokens, keys in prompts.items():
            times = alternate(partial(per_call, directory.lookup, keys), partial(per_call, dict_loop, keys), reps, tick)
            paired = summary(times, len(keys))  # "GB/s" here is 1e9 keys/s; renamed below
            by_size[str(block_tokens)] = {
                "keys": len(keys), "keys_per_s": paired["ours_gbps"] * 1e9,
                "dict_get_keys_per_s": paired["baseline_gbps"] * 1e9, "vs_dict_get": paired["ratio"],
                "keys_per_s_runs": [round(len(keys) / s) for s in times["ours_s"]],
            }
    finally:
        if was_enabled:
            gc.enable()
    return {
        "directory_blocks": n_blocks, "prompt_tokens": prompt_tokens, "by_block_tokens": by_size,
        "build_s": build_s,
        "build": "plan_store + kvtier.sim.instant_mover.complete_instantly, chains of 8192 random keys, gc disabled",
    }
