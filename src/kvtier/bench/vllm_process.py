"""One vLLM engine of `kvtier bench --vllm`, in a process of its own, kept for the whole bench and driven op by op.

The bench starts one such process per configuration, all at once, and sends each op in turn to every engine that
takes part (in the reverse order every other time), so that the engines compared are measured side by side in
time rather than one after the other. An op runs in one engine while the others wait idle; each op ends with
its engine idle (`_settle`), so no engine's background work (its stores) runs during another's op.

The protocol is one JSON line per op on the process's stdin and one per reply on its stdout; vLLM's own output
goes to stderr, which the bench keeps in a log file and shows when an engine fails.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

PROMPT = 4032  # tokens: a ~4k prefix and the last engine block, within the tiny model's 4,096 positions
FILLER = 2048
HITS = 3  # vLLM's own hits of each restored prompt: the restore's paired baseline is their median
UNIQUE_TOKENS = 512  # a unique prompt: short, so that a p99 rests on hundreds of them in a few minutes
SLOW_PROMPTS = 8  # prefixes of the slow-disk figures, served once and then in turn


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


class _Served:
    """The engine's side: what each op sends it."""

    def __init__(self, model: str, config: dict | None, delay_file: str) -> None:
        from kvtier.integrations.vllm.tiny_model import start_engine
        from vllm import SamplingParams

        if delay_file:
            from kvtier.rollout.faults import slow_reads

            slow_reads(Path(delay_file))
        self.llm = start_engine(model, config)
        self.params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
        self.slow_prompts = [tokens(f"slow-{i}", FILLER) + tokens(f"suffix-{i}", 64) for i in range(SLOW_PROMPTS)]
        self.ttft(tokens("warm-up", PROMPT))

    def ttft(self, prompt: list[int], settle: bool = True) -> tuple[float, int]:
        """(seconds to the first token, tokens vLLM reported cached) of one request; with `settle`, the request
        reaches an idle engine."""
        from vllm.inputs import TokensPrompt

        if settle:
            _settle(self.llm)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], self.params, use_tqdm=False)[0]
        return out.metrics.first_token_latency, out.num_cached_tokens

    def restore(self, rep: int) -> dict[str, float]:
        """A fresh prompt cold, then again after fillers evicted it from the engine, then vLLM's own hits of it."""
        prompt = tokens(f"prompt-{rep}", PROMPT)
        cold = self.ttft(prompt)[0]
        for k in range(3):  # 6,144 tokens of other traffic: the prompt leaves the engine's 48 blocks
            self.ttft(tokens(f"filler-{rep}-{k}", FILLER))
        restored, cached = self.ttft(prompt)
        hit = statistics.median(self.ttft(prompt)[0] for _ in range(HITS))
        return {"cold": cold, "restored": restored, "restored_cached": cached, "engine_hit": hit}

    def unique(self, round_: int, n: int) -> list[float]:
        """`n` prompts that share nothing, back to back: the stores of one land in the next one's steps, as
        under load. One more goes first, untimed: the first request after another engine's turn finds the
        caches cold, which a server that has the machine to itself does not."""
        self.ttft(tokens(f"unique-{round_}-first", UNIQUE_TOKENS), settle=False)
        return [self.ttft(tokens(f"unique-{round_}-{i}", UNIQUE_TOKENS), settle=False)[0] for i in range(n)]

    def slow_prime(self) -> None:
        """The slow-disk figures' prompts, served once (with a small host tier they end up on disk)."""
        for prompt in self.slow_prompts:
            self.ttft(prompt)

    def slow(self, i: int) -> tuple[float, int]:
        return self.ttft(self.slow_prompts[i % SLOW_PROMPTS])


def _settle(llm: Any, max_steps: int = 1000) -> None:
    """Step the engine until it holds no work, the connector's pending stores included: what `vllm serve`'s engine
    loop does between requests (`Scheduler.has_requests`), and what the offline `LLM` skips once its requests are
    done."""
    core = llm.llm_engine.engine_core.engine_core  # the in-process engine (`start_engine`)
    for _ in range(max_steps):
        if not core.scheduler.has_requests():
            return
        core.step_fn()


def _serve(model: str, config_json: str, delay_file: str) -> None:
    """The process's loop: one op per stdin line, its reply on the real stdout, everything else to stderr."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's logs (and any print) go to stderr from here on
    served = _Served(model, json.loads(config_json), delay_file)
    ops: dict[str, Callable[..., Any]] = {
        "restore": served.restore, "unique": served.unique, "slow_prime": served.slow_prime, "slow": served.slow}
    print(json.dumps("ready"), file=replies, flush=True)
    for line in sys.stdin:
        op, *args = json.loads(line)
        result = ops[op](*args)
        _settle(served.llm)
        print(json.dumps(result), file=replies, flush=True)


class Engine:
    """The bench's handle on one engine process."""

    def __init__(self, name: str, model: str, config: dict | None, folder: Path, env: dict[str, str],
                 slow_reads: bool = False) -> None:
        """Starts the process and returns at once (`ready` waits for it). `slow_reads`: its disk reads sleep
        as long as the seconds written to `delay_file` say (none until then)."""
        self.name = name
        self.log_path = folder / f"engine-{name}.log"
        self.delay_file = folder / f"engine-{name}.delay" if slow_reads else None
        self._log: IO[str] = open(self.log_path, "w")  # closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.bench.vllm_process", model, json.dumps(config), str(self.delay_file or "")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)

    def ready(self) -> None:
        self._reply()

    def ask(self, op: str, *args: int) -> Any:
        """Run one op in the engine and return its reply; the engine is idle again when this returns."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([op, *args]) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def slow_down(self, seconds: float) -> None:
        assert self.delay_file is not None, f"engine '{self.name}' was started without slow reads"
        self.delay_file.write_text(str(seconds))

    def _reply(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._log.flush()
            raise RuntimeError(f"engine '{self.name}' exited with {self.proc.returncode}:\n"
                               f"{self.log_path.read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        """End the process (its stdin closed, then killed if it does not exit) and its log."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3])
