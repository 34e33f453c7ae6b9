"""The cost model: what a block costs to move over each link, and what it costs to recompute instead.

Tiering pays only where loading a block is cheaper than recomputing it, and only within the request's latency
budget, so the analyzer's verdict and the simulator's TTFT both come from these few numbers. They are stated
defaults, not measurements: pass your own hardware's figures, or a profile that `kvtier calibrate` measured
(`apply_profile`; `with_profile` reads one from a file for the commands), whose fits replace them; `measured`
names what came from one, and `sources` says per figure where it came from, for every report.

Prefill FLOPs of `n` new tokens after `p` cached ones (the Mooncake FAST'25 form, causal attention):

    flops(n, p) = 2·P·n + L·A·(n·p + n·(n+1)/2)

P = active parameters, L = layers, A = attention FLOPs per (query, key) pair per layer = 2·(q·k width + v width).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtier.layout import KVLayout, preset
from kvtier.sim.profile import LineFit, PrefillFit, Profile, ProfileError, differences, load_profile, machine_identity
from kvtier.stores.base import TierKind

GB = 1e9
SOURCE_ORDER = ("measured", "stated", "default")  # where a figure came from, as the reports list them


@dataclass(frozen=True)
class ModelCompute:
    """What prefill costs for one model: active parameters and the attention width of one layer."""

    params: float
    attn_pair_flops: float  # per layer, per (query, key) pair


# Published HuggingFace configs: parameters; attention = 2 * (heads * (qk dim + v dim)).
COMPUTE: dict[str, ModelCompute] = {
    "llama-3.1-8b": ModelCompute(8.03e9, 2 * (4096 + 4096)),
    "llama-3.1-70b": ModelCompute(70.6e9, 2 * (8192 + 8192)),
    "qwen2.5-7b": ModelCompute(7.62e9, 2 * (3584 + 3584)),
    "qwen2.5-72b": ModelCompute(72.7e9, 2 * (8192 + 8192)),
    "mistral-7b": ModelCompute(7.24e9, 2 * (4096 + 4096)),
    "deepseek-v3": ModelCompute(37e9, 2 * (128 * 192 + 128 * 128)),  # 37B active of 671B; MLA, 128 heads
}


@dataclass(frozen=True)
class Link:
    """One transfer path: a fixed latency per transfer plus bytes over bandwidth."""

    name: str
    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    layout: KVLayout
    compute: ModelCompute
    flops_per_s: float = 400e12  # effective prefill FLOP/s of one engine: an H100 at ~40% of 989 TFLOP/s
    pcie: Link = field(default_factory=lambda: Link("pcie", 25 * GB, 10e-6))  # host <-> GPU
    disk: Link = field(default_factory=lambda: Link("disk", 6 * GB, 100e-6))  # one NVMe drive, reads
    network: Link = field(default_factory=lambda: Link("network", 12.5 * GB, 200e-6))  # 100 Gbit/s
    itl_s: float = 0.02  # seconds per output token while decoding (when a request's blocks get stored)
    prefill_fit: PrefillFit | None = None  # measured: replaces the FLOP count
    decode_fit: LineFit | None = None  # measured: seconds per output token over the batch
    measured: tuple[str, ...] = ()  # the figures a profile gave: "prefill", "decode", "pcie", "disk", "network"
    profile: Profile | None = field(default=None, compare=False, repr=False)  # what `measured` came from
    profile_file: str = field(default="", compare=False)  # its file, named in the reports

    def sources(self) -> dict[str, str]:
        """Per figure, where it came from: "measured (profile FILE, N points, rms X%): value", "default value" or
        "stated value" (the user's). Every report says which of its numbers were measured and which it assumes."""
        where = f"profile {self.profile_file}" if self.profile_file else "a profile"
        return {name: f"measured ({', '.join(filter(None, (where, fit)))}): {value}" if kind == "measured" else
                f"{kind} {value}" for name, (kind, fit, value) in self._sources().items()}

    def sources_text(self) -> str:
        """`sources` on one line for the terminal, grouped: "measured (profile FILE): prefill ... (N points, rms X%),
        ...; default: disk 6 GB/s, ..."."""
        groups: dict[str, list[str]] = {}
        for name, (kind, fit, value) in self._sources().items():
            groups.setdefault(kind, []).append(f"{name} {value}" + (f" ({fit})" if fit else ""))
        where = f" (profile {self.profile_file})" if self.profile_file else ""
        return "; ".join(f"{kind}{where if kind == 'measured' else ''}: {', '.join(items)}"
                         for kind, items in sorted(groups.items(), key=lambda g: SOURCE_ORDER.index(g[0])))

    def _sources(self) -> dict[str, tuple[str, str, str]]:
        """Per figure: (measured / default / stated, the fit's points and rms or "", the value)."""
        defaults = CostModel(self.layout, self.compute)

        def fit(f: PrefillFit | LineFit | None, what: str = "") -> str:
            points = f"{len(f.points)} points, rms {f.relative_rms:.1%}" if f is not None else ""
            return ", ".join(part for part in (what, points) if part)

        def stated(value: float, default: float, text: str) -> tuple[str, str, str]:
            return ("default" if value == default else "stated", "", text)

        out = {
            "prefill": ("measured", fit(self.prefill_fit), f"1,024 new tokens in {_time(self.prefill_seconds(1024))}")
            if "prefill" in self.measured else
            stated(self.flops_per_s, defaults.flops_per_s, f"{self.flops_per_s / 1e12:g} TFLOP/s effective"),
            "decode": ("measured", fit(self.decode_fit), f"{_time(self.itl_at(1))} per token at batch 1")
            if "decode" in self.measured else stated(self.itl_s, defaults.itl_s, f"{_time(self.itl_s)} per token"),
        }
        tiers = {link: tier for tier, link in PROFILE_LINKS.items()}
        for link, default in zip(self.links, defaults.links, strict=True):
            if link.name in self.measured:
                tier = tiers[link.name]
                out[link.name] = ("measured", fit(self.profile.tiers.get(tier) if self.profile else None,
                                                  f"load from {tier}"),
                                  f"{link.bytes_per_s / GB:.3g} GB/s + {_time(link.latency_s)}")
            else:
                out[link.name] = stated(link.bytes_per_s, default.bytes_per_s, f"{link.bytes_per_s / GB:g} GB/s")
        return out

    @property
    def links(self) -> tuple[Link, ...]:
        return (self.pcie, self.disk, self.network)

    def block_bytes(self, block_tokens: int) -> int:
        return self.layout.bytes_per_block(block_tokens)

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Compute time of a prefill of `new_tokens` that attends to `cached_tokens` already in the engine."""
        if self.prefill_fit is not None:
            return self.prefill_fit.seconds(new_tokens, cached_tokens)
        n, p = new_tokens, cached_tokens
        if n <= 0:
            return 0.0
        attention = self.layout.num_layers * self.compute.attn_pair_flops * (n * p + n * (n + 1) / 2)
        return (2 * self.compute.params * n + attention) / self.flops_per_s

    def itl_at(self, batch: int) -> float:
        """Seconds per output token with `batch` requests decoding side by side."""
        return self.decode_fit.seconds(max(1, batch)) if self.decode_fit is not None else self.itl_s

    def tier_path(self, kind: TierKind) -> tuple[Link, ...]:
        """The links a block crosses from a tier of this kind into the engine: every cold tier stages through
        host."""
        if kind is TierKind.HOST:
            return (self.pcie,)
        if kind is TierKind.DISK:
            return (self.disk, self.pcie)
        return (self.network, self.pcie)


def cost_model(
    model: str = "llama-3.1-8b", tflops: float = 400, pcie_gbs: float = 25, disk_gbs: float = 6,
    network_gbs: float = 12.5, itl_ms: float = 20,
) -> CostModel:
    """A cost model for a layout preset; bandwidths in GB/s (1e9 bytes), compute in effective TFLOP/s."""
    for name, value in (("tflops", tflops), ("pcie_gbs", pcie_gbs), ("disk_gbs", disk_gbs),
                        ("network_gbs", network_gbs)):
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if itl_ms < 0:
        raise ValueError(f"--itl-ms must be >= 0, got {itl_ms}")
    layout = preset(model)
    return CostModel(
        layout, COMPUTE[model], tflops * 1e12, Link("pcie", pcie_gbs * GB, 10e-6),
        Link("disk", disk_gbs * GB, 100e-6), Link("network", network_gbs * GB, 200e-6), itl_ms / 1e3,
    )


PROFILE_LINKS = {"host": "pcie", "disk": "disk", "redis": "network"}  # a tier's load in a profile -> its link


def apply_profile(cost: CostModel, profile: Profile) -> CostModel:
    """`cost` with what `profile` measured in place of its defaults: the prefill fit, decode per token (at batch 1
    as `itl_s`), each measured tier's load as its link (latency + bytes over bandwidth), the served model's block
    bytes when the profile knows its KV bytes per token."""
    links: dict[str, Link] = {}
    for tier, name in PROFILE_LINKS.items():
        fit = profile.tiers.get(tier)
        if fit is not None:
            links[name] = Link(name, fit.bytes_per_s, fit.intercept)
    layout = cost.layout
    per_token = profile.server.get("kv_bytes_per_token")
    if per_token and layout.bytes_per_block(1) != per_token:
        layout = _layout_of(per_token, profile.server.get("model") or "profiled")
    return replace(cost, layout=layout, prefill_fit=profile.prefill, decode_fit=profile.decode,
                   itl_s=profile.decode.seconds(1), measured=("prefill", "decode", *links),
                   pcie=links.get("pcie", cost.pcie), disk=links.get("disk", cost.disk),
                   network=links.get("network", cost.network))


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def _layout_of(bytes_per_token: int, name: str) -> KVLayout:
    """A layout of the profiled model's bytes per token: only its size matters to the cost model."""
    return KVLayout(1, 1, bytes_per_token, "int8", mla_latent_dim=bytes_per_token, name=name)


# ------------------------------------------------------------------------------------------------ from a file

FLAG_FIGURES = {"--tflops": "prefill", "--itl-ms": "decode", "--pcie-gbs": "pcie", "--disk-gbs": "disk",
                "--network-gbs": "network"}  # each stated-default flag, and the figure it states


def with_profile(cost: CostModel, path: Path, flags: Iterable[str] = (), model_given: bool = True,
                 machine: dict | None = None) -> tuple[CostModel, list[str]]:
    """`cost` with the profile at `path` in place of its defaults, and warnings for the report. ProfileError (a
    ValueError: exit code 2) when the file is not a usable profile, when `flags` (those the user gave) state a
    figure the profile measured (two answers to one question), or, `model_given`, when the profile measured
    another model (KV bytes per token differ: every block size and transfer would be wrong). A profile from
    another machine is only warned about: planning is often done away from the machine it plans for."""
    profile = load_profile(path)
    per_token = profile.server.get("kv_bytes_per_token")
    mismatch = differences(profile, server={"kv_bytes_per_token": cost.layout.bytes_per_token})
    if model_given and mismatch:
        raise ProfileError(f"--model {cost.layout.name} has {cost.layout.bytes_per_token:,} B of KV per token, but "
                           f"the profile {path} measured {profile.server.get('model') or 'its model'} at "
                           f"{per_token:,} B per token: pass that model, or a profile of this one")
    profiled = replace(apply_profile(cost, profile), profile=profile, profile_file=str(path))
    if not model_given and profile.server.get("model"):
        profiled = replace(profiled, layout=replace(profiled.layout, name=str(profile.server["model"])))
    for flag in flags:
        if FLAG_FIGURES.get(flag) in profiled.measured:
            raise ProfileError(f"{flag}: the profile {path} measured {FLAG_FIGURES[flag]}; pass {flag} or --profile, "
                               "not both (a flag applies alongside a profile only to a figure it did not measure)")
    elsewhere = differences(profile, machine=machine_identity() if machine is None else machine)
    warnings = [f"the profile {path} was measured on another machine ({'; '.join(elsewhere)}): its figures are "
                "that machine's"] if elsewhere else []
    return profiled, warnings
