"""The rollout's harness: the servers it starts, the traffic it sends, the load of each level and the tiers of
each step. `kvtier.rollout.steps` runs the steps through it, `kvtier.rollout.drills` the drills;
`kvtier.rollout.run` is the command's entry."""

from __future__ import annotations

import random
import re
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.rollout import client, figures, predict, workload
from kvtier.rollout.options import Options, step_configs
from kvtier.rollout.server import MAX_MODEL_LEN, Server, embedded_command, free_port, template_command
from kvtier.rollout.sizes import RolloutSizes, bytes_per_token
from kvtier.sim.cost import CostModel

DRILL_WINDOW_BUDGETS = 3  # the rollback drill's guard window, in budgets: two slowed requests and a margin
PROBE_REQUESTS = 4  # unique prompts timed one at a time on the first server: the engine's service time
SPEED_PROMPTS, SPEED_TOKENS = 4, 512  # fresh prompts timed on each server before its levels: its prefill speed
BUSIEST = 0.8  # the busiest closed-loop level has a request in flight this share of its time, were every prompt
#   recomputed: below the 0.9 that marks a level saturated, for requests that run longer side by side


@dataclass
class Rollout:
    opts: Options
    root: Path
    progress: Any
    model: str | None = None
    report: dict = field(default_factory=dict)
    sizes: RolloutSizes | None = None
    service_s: float | None = None  # a recomputed prompt's mean end-to-end time, one at a time (`probe`)
    cost: CostModel | None = None  # what the first server was measured to cost (`calibrate`): the predictions'

    # ---------------------------------------------------------------- servers

    def start(self, name: str, kvtier: dict | None, engine_blocks: int, env: dict[str, str] | None = None) -> Server:
        port = free_port()
        if self.opts.command:
            command = template_command(self.opts.command, kvtier, port)
        else:
            assert self.model is not None
            command = embedded_command(self.model, kvtier, engine_blocks, port)
        server = Server(command, port, self.root / "logs" / f"{name}.log", env,
                        model=None if self.opts.command else self.model)
        self.ready(server, name)
        if self.service_s is None:
            try:
                self.probe(server)
                if self.opts.predict:
                    self.calibrate(server)
            except BaseException:
                server.kill()
                raise
        return server

    def ready(self, server: Server, name: str) -> float:
        """Seconds until the (just started) server answers, then one request it computes before any measured
        one: the engine's first-request costs are not the tiers'."""
        task = self.progress.add_task(f"{name}: starting the server", total=None)
        try:
            seconds = server.wait_ready()
            client.send(server.url, server.model or "", [client.Prompt([7] * 300, "warm-up", 2)])
            return seconds
        except BaseException:
            server.kill()
            raise
        finally:
            self.progress.remove_task(task)

    def probe(self, server: Server) -> None:
        """Measure the server's capacity before any level: unique prompts of the workload's kind, one at a time,
        computed in full. The default think time and the open-loop rates are stated in terms of it."""
        prompts = [p for p in self.workload(999) if not p.reused][:PROBE_REQUESTS]
        results = client.send(server.url, server.model or "", prompts)
        ok = [r.e2e for r in results if r.error is None]
        if not ok:
            raise RuntimeError(f"the server answered no probe request: {results[0].error if results else 'none'}")
        self.service_s = sum(ok) / len(ok)
        self.report["capacity"] = {"service_s": self.service_s, "requests_per_s": 1 / self.service_s,
                                   "probe_requests": len(ok), "think_s": self.think_s()}

    def calibrate(self, server: Server) -> None:
        """The costs the predictions use: `--profile`'s, or measured now on this server (prefill, decode) and on
        this machine (each tier's load, at the served model's block bytes)."""
        from kvtier.sim.cost import apply_profile, cost_model
        from kvtier.sim.profile import differences, load_profile, machine_identity

        if self.opts.profile is not None:
            profile = load_profile(self.opts.profile)
        else:
            from kvtier.calibrate.calibrate import calibrate

            model = self.opts.model if self.opts.command else self.model
            per_token = bytes_per_token(model) if model is not None else None
            profile = calibrate(server.url, server.model or "", per_token, disk_root=self.opts.disk_root or self.root,
                                progress=self.progress)
        self.cost = apply_profile(cost_model(), profile)
        geometry = engine_geometry(server)
        here = {"model": server.model, "block_size": geometry[1] if geometry else None}
        source = str(self.opts.profile) if self.opts.profile else "measured on the first server"
        self.report["profile"] = {**profile.as_dict(), "residuals": profile.residuals(), "from": source,
                                  "differs": differences(profile, machine_identity(), here)}

    def think_s(self) -> float:
        """Each closed-loop client's mean think time: as given, or such that the busiest level's N clients, each
        request taking the service time S and each client thinking on its own, keep a request in flight a BUSIEST
        share of the time: 1 - (1 - S / (S + think))^N = BUSIEST."""
        if self.opts.think_s is not None:
            return self.opts.think_s
        assert self.service_s is not None
        in_flight = 1 - (1 - BUSIEST) ** (1 / max(self.opts.levels))  # each client's share with a request out
        return self.service_s * (1 / in_flight - 1)

    def loads(self) -> list[client.Load]:
        if self.opts.rates:
            assert self.service_s is not None
            return [client.Load(rate=r / self.service_s) for r in self.opts.rates]
        return [client.Load(clients=c, think_s=self.think_s()) for c in self.opts.levels]

    # ---------------------------------------------------------------- tiers

    def guard(self, step: str) -> dict | None:
        """Windows short enough to act within a run: 5 s, or, for the rollback drill, long enough to hold two of
        its requests, each slowed past the budget (one request at a time)."""
        budget = self.report.get("drill_budget_ms" if step == "rollback" else "budget_ms")
        if budget is None:
            return None
        window_s = max(5.0, DRILL_WINDOW_BUDGETS * budget / 1e3) if step == "rollback" else 5.0
        return {"ttft_p99_ms": budget, "window_s": window_s, "breach_windows": 2, "of_windows": 3,
                "min_requests": 2, "hold_s": 6, "probe_share": 0.5}

    def kvtier(self, step: str) -> dict:
        """The step's kv_connector_extra_config: `--kv-config`'s, or the sized tiers with the rollout's guard."""
        given = step_configs(self.opts.kv_config) if self.opts.kv_config else {}
        if step in given:
            return given[step]
        assert self.sizes is not None
        guard = self.guard(step)
        host = {"cpu_bytes_to_use": self.sizes.host_bytes, **({"guard": guard} if guard else {})}
        if step == "host":
            return host
        root = self.opts.disk_root / f"kvtier-{step}" if self.opts.disk_root else self.root / step / "kv"
        disk = {"type": "fs", "root_dir": str(root), "max_bytes": self.sizes.disk_bytes}
        if step == "rollback":  # the drill is about the guard: the disk keeps what host evicts, and is read
            return {**host, "secondary_tiers": [{**disk, "admission": {"min_sightings": 1}}], "load_policy": "always"}
        return {**host, "secondary_tiers": [disk]}

    def disk_root(self, step: str) -> Path:
        return Path(self.kvtier(step)["secondary_tiers"][0]["root_dir"])

    # ---------------------------------------------------------------- traffic

    def workload(self, salt: int) -> list[client.Prompt]:
        limit = MAX_MODEL_LEN - self.opts.max_tokens - 1
        if self.opts.trace is not None:
            return workload.from_trace(self.opts.trace, self.opts.requests, salt, self.opts.max_tokens, limit)
        return workload.builtin(self.opts.requests, self.opts.seed * 1000 + salt, self.opts.max_tokens, limit)

    def measure(self, server: Server, label: str, prompts: list[client.Prompt],
                load: client.Load = client.ONE_AT_A_TIME) -> dict:
        """Send `prompts` and summarize: latency from the client, tokens by source from /metrics deltas."""
        task = self.progress.add_task(label, total=len(prompts))
        before = server.metrics()
        results = client.send(server.url, server.model or "", prompts, load, seed=self.opts.seed,
                              on_done=lambda: self.progress.advance(task))
        time.sleep(1.0)  # the engine's last stats reach /metrics
        after = server.metrics()
        self.progress.remove_task(task)
        return figures.summarize(label, results, load, figures.delta(before, after))

    def speed(self, server: Server, step: str) -> float:
        """This server's prefill time over the profile's: the median ratio of `SPEED_PROMPTS` fresh prompts, timed
        one at a time before its levels. Two processes of one build run some percent apart on a shared machine;
        the predictions of this server's levels scale the profile's prefill by it."""
        assert self.cost is not None and self.cost.prefill_fit is not None
        rng = random.Random(f"{self.opts.seed}/speed/{step}")
        prompts = [client.Prompt(workload.fresh_tokens(rng, SPEED_TOKENS), "speed", 1) for _ in range(SPEED_PROMPTS)]
        ratios = [r.ttft / self.cost.prefill_fit.seconds(SPEED_TOKENS)
                  for r in client.send(server.url, server.model or "", prompts) if r.error is None]
        return statistics.median(ratios) if ratios else 1.0

    def levels(self, server: Server, step: str, kvtier: dict | None, count: int | None = None) -> list[dict]:
        """Every load level (the first `count`), each with a workload of its own, predicted before it is sent."""
        out = []
        geometry = engine_geometry(server) if self.cost is not None else None
        cost = self.cost
        if cost is not None and cost.prefill_fit is not None and geometry is not None:
            factor = self.speed(server, step)
            self.report.setdefault("server_speed", {})[step] = factor
            cost = replace(cost, prefill_fit=cost.prefill_fit.scaled(factor))
        for index, load in enumerate(self.loads()[:count]):
            name = f"{load.clients} client{'s' if load.clients > 1 else ''}" if load.closed else \
                f"{load.rate:.2f} req/s"
            prompts = self.workload(index + 1)
            predicted, others = None, []
            if cost is not None and geometry is not None:
                blocks, block_tokens = geometry
                predicted = predict.predict(cost, prompts, load, kvtier, blocks, block_tokens, self.opts.seed)
                others = predict.other_draws(cost, prompts, load, kvtier, blocks, block_tokens, self.opts.seed)
            summary = self.measure(server, f"{step}: {name}", prompts, load)
            summary["level"] = load.clients if load.closed else index + 1
            if predicted is not None:
                summary["predicted"] = predict.compare(predicted, prompts, summary,
                                                       judged=load.closed and load.clients == 1, others=others)
            out.append(summary)
        return out

    def sent_workloads(self) -> list[list[client.Prompt]]:
        """The workloads the levels send, in order: what the tiers are sized for."""
        return [self.workload(index + 1) for index in range(self.opts.loads)]


def engine_geometry(server: Server) -> tuple[int, int] | None:
    """(KV blocks, tokens per block) of the server's engine, from vLLM's `cache_config_info`; None if not exported."""
    for key in server.metrics("vllm:cache_config_info"):
        blocks = re.search(r'num_gpu_blocks="(\d+)"', key)
        size = re.search(r'block_size="(\d+)"', key)
        if blocks and size:
            return int(blocks.group(1)), int(size.group(1))
    return None
