"""The terminal tables of `kvtier bench`: ours, the baseline, their ratio and the target, per figure."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

KiB, MiB = 1 << 10, 1 << 20


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes % MiB == 0 else f"{nbytes // KiB}KiB"


def print_tiers(console: Console, result: dict) -> None:
    table = Table(title="kvtier bench: ours vs baseline, medians of paired runs")
    for column in ("figure", "ours", "baseline", "ratio", "target", ""):
        table.add_column(column, justify="left" if column == "figure" else "right")

    def row(name: str, ours: str, base: str, ratio: float, target: str, met: bool | None) -> None:
        mark = "" if met is None else ("[green]ok[/]" if met else "[red]MISSED[/]")
        table.add_row(name, ours, base, f"{ratio:.3f}", target, mark)

    for size, case in result["host_vs_copy_by_size"].items():
        row(f"host {size}", f"{case['ours_gbps']:.2f} GB/s", f"{case['baseline_gbps']:.2f} GB/s",
            case["ratio"], "", None)
    t = result["targets"]
    row("host_vs_copy (min)", "", "copy_", t["host_vs_copy"]["value"], "≥ 0.9", t["host_vs_copy"]["met"])
    for case in result["engine_pages"]:
        row(f"pages, {case['geometry']}", f"{case['ours_gbps']:.2f} GB/s", f"{case['baseline_gbps']:.2f} GB/s",
            case["ratio"], "", None)
        row(f"  as {case['parts_per_block']} parts", f"{case['parts']['ours_gbps']:.2f} GB/s",
            f"{case['parts']['baseline_gbps']:.2f} GB/s", case["parts"]["ratio"], "", None)
    for side in ("write", "write_full", "read"):
        case, name = result["disk"][side], f"disk_{side}_vs_raw"
        row(name, f"{case['ours_gbps']:.2f} GB/s", f"{case['baseline_gbps']:.2f} GB/s", case["ratio"],
            f"≥ {t[name]['target']}", t[name]["met"])
    for size, by_side in result["disk_by_size"].items():
        for side in ("write", "write_full", "read"):
            case = by_side[side]
            row(f"  disk {size} {side}", f"{case['ours_gbps']:.2f} GB/s", f"{case['baseline_gbps']:.2f} GB/s",
                case["ratio"], "", None)
    for tokens, case in result["lookup"]["by_block_tokens"].items():
        table.add_row(f"lookup {case['keys']} keys ({tokens} tok)", f"{case['keys_per_s'] / 1e6:.2f} M/s",
                      f"{case['dict_get_keys_per_s'] / 1e6:.2f} M/s", f"{case['vs_dict_get']:.3f}", "", "")
    value = t["lookup_keys_per_s"]["value"]
    table.add_row("lookup_keys_per_s (min)", f"{value / 1e6:.2f} M/s", "dict.get", "", "≥ 1.00 M/s",
                  "[green]ok[/]" if t["lookup_keys_per_s"]["met"] else "[red]MISSED[/]")
    console.print(table)
    others = result["machine"]["other_processes_cpus"]
    if result["noisy"]:
        console.print(f"[yellow]warning: other processes kept {others:.1f} of {result['machine']['cpus']} CPUs busy "
                      "during the run; torch's threads then stall on each other and the figures are noisy[/]")
    console.print(f"directory of {result['lookup']['directory_blocks']:,} blocks built in "
                  f"{result['lookup']['build_s']:.1f} s; disk benchmark ran in {result['disk']['file_system_dir']} "
                  f"(O_DIRECT tier={result['disk']['tier_o_direct']}, raw={result['disk']['raw_o_direct']})")


def print_scheduler(console: Console, figures: dict) -> None:
    """`kvtier.bench.scheduler`: milliseconds of the scheduler thread per request, and the ratio to vLLM's hashing."""
    table = Table(title=f"scheduler_ms_per_request: one request, vLLM's {figures['block_tokens']}-token blocks, warm "
                  "tiers, medians of paired rounds (lower is better)")
    for column in ("request", "part", "kvtier", "vLLM hashing", "ratio", "rounds", "target", ""):
        table.add_column(column, justify="left" if column in ("request", "part") else "right")
    longest = max(c["tokens"] for c in figures["cases"])  # the target is the longest prompt's
    for case in figures["cases"]:
        long = case["tokens"] == longest
        for part, what in (("load", "lookup+plan_load+done"), ("store", "plan_store+done")):
            if f"{part}_ratio" not in case:
                continue
            ratio = case[f"{part}_ratio"]
            runs = case[f"{part}_ratio_runs"]
            met = "" if not long else ("[green]ok[/]" if ratio <= figures["target"] else "[red]MISSED[/]")
            state = ", host + disk, evicting" if case.get("demote") else ", evicting" if case["evict"] else ""
            blocks = "" if case["block_tokens"] == figures["block_tokens"] else f", {case['block_tokens']}-tok blocks"
            table.add_row(f"{case['tokens'] // 1024}k tok{blocks}{state}", what,
                          f"{case[f'{part}_ms']:.1f} ms", f"{case[f'{part}_vllm_hashing_ms']:.1f} ms", f"{ratio:.2f}",
                          f"{len(runs)} ({min(runs):.2f}-{max(runs):.2f})", f"≤ {figures['target']}" if long else "",
                          met)
    if "connector" in figures:  # the same request through the connector's hooks, on vLLM's own Request
        hooks = figures["connector"]
        for part, what in (("hit", "hooks: found, loaded, finished"), ("miss", "hooks: missed, stored")):
            runs = hooks[f"{part}_ratio_runs"]
            table.add_row(f"{hooks['tokens'] // 1024}k tok, connector", what, f"{hooks[f'{part}_ms']:.1f} ms",
                          f"{hooks[f'{part}_vllm_hashing_ms']:.1f} ms", f"{hooks[f'{part}_ratio']:.2f}",
                          f"{len(runs)} ({min(runs):.2f}-{max(runs):.2f})", "", "")
    if "sent" in figures:  # what vLLM's multiprocess executor pickles on the same thread, for its ranks
        sent = figures["sent"]
        for part in ("load", "store"):
            runs = sent[f"{part}_sent_ratio_runs"]
            table.add_row(f"{sent['tokens'] // 1024}k tok, sent to ranks", f"{part} job pickled",
                          f"{sent[f'{part}_sent_ms']:.1f} ms", f"{sent[f'{part}_sent_vllm_hashing_ms']:.1f} ms",
                          f"{sent[f'{part}_sent_ratio']:.2f}", f"{len(runs)} ({min(runs):.2f}-{max(runs):.2f})", "",
                          f"unpickled {sent[f'{part}_received_ms']:.1f} ms")
    console.print(table)
    if "collector" in figures:
        c = figures["collector"]
        runs = c["full_collection_ms_runs"]
        console.print(f"the collector, {c['blocks']:,} directory blocks and nothing else to scan "
                      f"({c['tracked_objects_per_block']:g} tracked objects per block): a full collection "
                      f"{c['full_collection_ms']:.1f} ms (median of {len(runs)}, {min(runs):.1f}-{max(runs):.1f}); "
                      f"a 128k store that evicts as much, median of {c['stores']}: "
                      f"{c['store_ms_collector_off']:.1f} ms with it off, "
                      f"{c['store_ms_collector_on']:.1f} ms with it on (max {c['store_ms_collector_on_max']:.1f}, "
                      f"{c['full_collections_while_storing']} full collections)")


def print_simulator(console: Console, sim: dict) -> None:
    table = Table(title=f"simulator vs libcachesim: {sim['accesses']:,} block accesses of the Mooncake conversation "
                  "trace, medians")
    for column in ("figure", "ours", "libcachesim", "ratio", "target", ""):
        table.add_column(column, justify="left" if column == "figure" else "right")
    met = sim.get("targets_met", {})

    def mark(name: str) -> str:
        return "" if name not in met else ("[green]ok[/]" if met[name] else "[red]MISSED[/]")

    if "libcachesim_lru_points_s" in sim:
        table.add_row("mrc_vs_libcachesim", f"{sim['mrc_s'] * 1e3:.0f} ms (every capacity)",
                      f"{sim['libcachesim_lru_points_s'] * 1e3:.0f} ms (10 capacities)",
                      f"{sim['mrc_vs_libcachesim']:.3f}", "< 1", mark("mrc_vs_libcachesim"))
    for policy in ("lru", "arc", "s3fifo"):
        ours = sim.get(f"replay_{policy}_accesses_per_s")
        theirs = sim.get(f"libcachesim_{policy}_accesses_per_s")
        if ours is None:
            continue
        name = f"replay_{policy}_accesses_per_s"
        target = sim.get("targets", {}).get(name)
        table.add_row(name, f"{ours / 1e6:.2f} M/s", f"{theirs / 1e6:.2f} M/s (C loop)" if theirs else "",
                      f"{ours / theirs:.3f}" if theirs else "", f"≥ {target / 1e6:.2f} M/s" if target else "",
                      mark(name))
    if "simulate_command_s" in sim:
        table.add_row("simulate_command_s", f"{sim['simulate_command_s']:.1f} s ({sim['simulate_workers']} processes)",
                      "", "", "≤ 3 s", "[green]ok[/]" if sim["simulate_command_s"] <= 3 else "[red]MISSED[/]")
    console.print(table)


def print_redis(console: Console, redis: dict) -> None:
    table = Table(title=f"redis tier vs raw redis-py pipelined SET/GET, same server ({redis['parser']} parser)")
    for column in ("block", "put ours", "put raw", "put ratio", "get ours", "get raw", "get ratio"):
        table.add_column(column, justify="left" if column == "block" else "right")
    for size, case in redis["redis_vs_raw"].items():
        table.add_row(size, f"{case['tier_put_GBps']:.2f} GB/s", f"{case['raw_put_GBps']:.2f} GB/s",
                      f"{case['put_ratio']:.3f}", f"{case['tier_get_GBps']:.2f} GB/s",
                      f"{case['raw_get_GBps']:.2f} GB/s",
                      f"{case['get_ratio']:.3f}")
    console.print(table)
    ok = redis["min_ratio"] >= redis["target"]
    console.print(f"redis_vs_raw (min) {redis['min_ratio']:.3f}, target ≥ {redis['target']}: "
                  + ("[green]ok[/]" if ok else "[red]MISSED[/]"))


def print_redis_cluster(console: Console, figures: dict) -> None:
    """The cluster tier's three figures (`kvtier.bench.redis_cluster_tier`)."""
    case = figures["redis_cluster_vs_raw"]
    table = Table(title=f"redis cluster tier vs raw RedisCluster pipelines, {case['block_bytes'] >> 20} MiB blocks, "
                        f"{case['threads']} chains in flight, {case['runs']} paired runs")
    for column in ("op", "ours", "raw", "ratio (median)", "runs"):
        table.add_column(column, justify="left" if column == "op" else "right")
    for op in ("put", "get"):
        table.add_row(op, f"{case[f'tier_{op}_GBps']:.2f} GB/s", f"{case[f'raw_{op}_GBps']:.2f} GB/s",
                      f"{case[f'{op}_ratio']:.3f}", " ".join(f"{r:.2f}" for r in case[f"{op}_ratio_runs"]))
    console.print(table)
    ok = figures["min_ratio"] >= figures["target"]
    console.print(f"redis_cluster_vs_raw (min) {figures['min_ratio']:.3f}, target ≥ {figures['target']}: "
                  + ("[green]ok[/]" if ok else "[red]MISSED[/]"))
    spread = figures["spread"]
    if "skipped" in spread:
        console.print(f"[yellow]spread over primaries skipped: {spread['skipped']}[/]")
    else:
        console.print(f"spread over {len(spread['bytes_per_primary'])} primaries, {spread['requests']} requests of the "
                      f"Mooncake conversation trace, {spread['partitions']} partitions: bytes max/mean "
                      f"{spread['bytes_max_over_mean']:.3f}, commands max/mean {spread['commands_max_over_mean']:.3f} "
                      f"(target ≤ {spread['target']}), blocks held per distinct block {spread['copies']:.4f}")
    lookup = figures["lookup_vs_one_node"]
    console.print(f"{lookup['blocks']}-block lookup: cluster {lookup['cluster_us']:.0f} µs, one node "
                  f"{lookup['one_node_us']:.0f} µs ({lookup['cluster_over_one_node']:.3f}x, medians of "
                  f"{lookup['rounds']} rounds)")
