"""A plan as a report: the verdict, one table per GPU and for the host, the tiers, the flags; in HTML a stacked bar
per device and for the host."""

from __future__ import annotations

from kvtier.plan.budget import WORKSPACE_ASSUMPTION, GiB
from kvtier.plan.make import MemoryPlan
from kvtier.report import Heading, Plot, Report, Table, Text, fmt_bytes, fmt_share


def plan_report(plan: MemoryPlan) -> Report:
    m, g, h, s, tp = plan.model, plan.gpu, plan.host, plan.sizes, plan.inputs.tp
    report = Report(f"kvtier plan — {m.name}", data=plan.as_dict())
    report.add(Text(f"{m.params.total / 1e9:,.2f} B parameters ({m.params.active / 1e9:,.2f} B active), "
                    f"{fmt_bytes(m.weight_bytes)} of weights; {m.layout.bytes_per_token:,} B of {m.layout.dtype} KV "
                    f"per token; tensor parallel {tp}."))
    if plan.cost is not None:
        report.add(Text(f"cost model (the latency check, the weight-offload warning): {plan.cost.sources_text()}"))
    for warning in plan.warnings:
        report.add(Text(f"warning: {warning}", "bold red"))
    verdict = "offload: deploy kvtier with the flags below" if s.offload else \
        "do not offload: " + "; and ".join(c.reason for c in s.checks if c.ok is False)
    report.add(Heading("Verdict"), Text(verdict, "bold green" if s.offload else "bold red"))
    if s.checks:
        report.add(Table("checks", ["check", "ok", "why"],
                         [[c.name, {True: "yes", False: "NO", None: "-"}[c.ok], c.reason] for c in s.checks],
                         text_columns=3))
    report.add(*[Text(f"note: {n}", "yellow") for n in s.notes])
    kv_line = "kv_cache_memory_bytes (no profile)" if g.kv_cache_memory_given else "engine KV"
    report.add(Heading(f"Each GPU (x{tp})"), Table("the GPU, in the order vLLM claims it", COLUMNS, _rows(
        ("total", g.total_bytes), (f"usable (x {plan.inputs.gpu_util:g})", g.usable_bytes),
        ("weights", g.weights_bytes), ("non-torch memory", g.non_torch_bytes), ("activation peak", g.activation_bytes),
        (kv_line, g.kv_bytes), ("left unused", g.free_bytes))))
    if not g.kv_cache_memory_given and plan.inputs.workspace_gib is None:
        report.add(Text(f"assumed: {WORKSPACE_ASSUMPTION}"))
    report.add(Text(f"engine KV: {g.kv_blocks:,} blocks of {g.block_tokens} tokens = {g.kv_tokens:,} tokens "
                    f"({g.kv_bytes_per_token:,} B per token per GPU): {g.max_model_len_sequences:,.1f} sequences of "
                    f"max_model_len {g.max_model_len:,}."))
    report.add(Heading("The host"), Table("host RAM, in the order it is claimed", COLUMNS, _rows(
            ("total", h.total_bytes), ("OS and other services (reserved)", h.reserved_bytes),
            ("serving processes", h.process_bytes), ("offloaded weights", h.offloaded_weights_bytes),
            ("page cache for the storage tier", h.page_cache_bytes), ("kvtier slab", h.slab_bytes),
            ("free", h.free_bytes))),
        Text(f"the slab is {h.slab_slots_per_rank:,} slots of {h.slot_bytes:,} B per rank, one mmap each, exactly; "
             f"one pinned torch tensor of the same size would reserve {fmt_bytes(h.pinned_pow2_bytes)} (torch's "
             "pinned allocator rounds each block up to a power of two unless PYTORCH_ALLOC_CONF sets "
             "pinned_max_round_threshold_mb). kvtier's disk tier uses O_DIRECT: no page cache."))
    columns = ["tier", "size", "token hit ratio (LRU curve)", "token hit ratio (replay)"]
    report.add(Heading("Tiers"), Table("sizes (the whole model's KV)", columns, _tier_rows(plan)))
    if s.knee is not None:
        report.add(Text(f"the knee: {fmt_bytes(s.knee)} of KV reaches 95% of the hit ratio any cache size could"))
    report.add(Heading("Flags"), Text(plan.vllm_flags), Text(f"TensorRT-LLM: {plan.trtllm}"))
    report.add(Plot("memory per device", lambda ax: _bars(ax, plan), xlabel="GiB"))
    return report


COLUMNS = ["part", "bytes", "GiB"]


def _rows(*parts: tuple[str, int]) -> list[list[str]]:
    return [[name, f"{v:,}", f"{v / GiB:,.2f}"] for name, v in parts]


def _tier_rows(plan: MemoryPlan) -> list[list[str]]:
    s = plan.sizes
    rows = []
    for name, size, key in (("engine", s.engine, "engine"), ("host", s.host, "engine + host"),
                            ("disk", s.disk, "engine + host + disk")):
        curve = s.curve_hits.get(key)
        replay = s.replay_hits.get(key)
        rows.append([name, fmt_bytes(size), "-" if curve is None else fmt_share(curve),
                     "-" if replay is None else fmt_share(replay)])
    return rows


PARTS = (("weights", "#4c72b0"), ("workspace", "#8172b2"), ("engine KV", "#55a868"),
         ("reserved + processes", "#937860"), ("offloaded weights", "#c44e52"), ("page cache", "#ccb974"),
         ("kvtier slab", "#64b5cd"), ("free", "#dddddd"))


def _bars(ax, plan: MemoryPlan) -> None:
    g, h = plan.gpu, plan.host
    rows = {
        f"each GPU (x{plan.inputs.tp})": {"weights": g.weights_bytes, "workspace": g.workspace_bytes,
                                          "engine KV": g.kv_bytes, "free": g.total_bytes - g.usable_bytes
                                          + g.free_bytes},
        "host": {"reserved + processes": h.reserved_bytes + h.process_bytes,
                 "offloaded weights": h.offloaded_weights_bytes, "page cache": h.page_cache_bytes,
                 "kvtier slab": h.slab_bytes, "free": h.free_bytes},
    }
    labelled: set[str] = set()
    for y, parts in enumerate(rows.values()):
        left = 0.0
        for part, color in PARTS:
            width = parts.get(part, 0) / GiB
            if width > 0:
                ax.barh(y, width, left=left, color=color, label=None if part in labelled else part)
                labelled.add(part)
                left += width
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
