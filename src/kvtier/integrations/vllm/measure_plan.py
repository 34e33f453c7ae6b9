"""`kvtier plan --measure`: the plan's prediction against what this machine's vLLM CPU engine allocates.

The CPU backend has no GPU profile: its KV budget is `kv_cache_memory_bytes` (VLLM_CPU_KVCACHE_SPACE), so what is
checked is the rest of the arithmetic: the KV blocks the engine allocates, against the plan's bytes per block from
the model's config (layers, KV heads, head size, dtype, block size); and the weights' bytes counted from the config,
against the tensors the checkpoint's safetensors headers list (the CPU engine repacks its linear layers' weights
out of their parameters, so its modules cannot be counted). vLLM is imported here only.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from kvtier.plan.make import PlanInputs, make_plan
from kvtier.report import Report, Table, Text

TOLERANCE = 0.02
CPU_BLOCK_TOKENS = 128  # the CPU backend's default block size


def measure(inputs: PlanInputs, json_path: Path | None) -> int:
    """`inputs.model`: a local model folder, or the default preset for the tiny model built here. Exit code 0 when
    both predictions are within TOLERANCE of the engine's figures, 1 otherwise."""
    with tempfile.TemporaryDirectory(prefix="kvtier-measure-") as scratch:
        model = inputs.model
        if model == PlanInputs.model:
            from kvtier.integrations.vllm.tiny_model import build_tiny_llama

            model = build_tiny_llama(Path(scratch) / "tiny")
        elif not Path(model).is_dir():
            raise ValueError(f"--model {model!r}: --measure serves a local model folder (weights and config.json)")
        engine_block = inputs.engine_block_tokens if inputs.engine_block_tokens != PlanInputs.engine_block_tokens \
            else CPU_BLOCK_TOKENS
        plan = make_plan(replace(inputs, model=model, kv_cache_gib=inputs.kv_cache_gib or 1, trace=None,
                                 engine_block_tokens=engine_block,
                                 block_tokens=max(inputs.block_tokens or 0, engine_block)))
        engine_blocks = _engine_blocks(model, plan.gpu.kv_bytes, engine_block, plan.gpu.max_model_len,
                                       inputs.max_num_seqs, inputs.max_batched_tokens)
        checkpoint = checkpoint_bytes(Path(model))
    rows = [("KV blocks", plan.gpu.kv_blocks, engine_blocks), ("weight bytes", plan.model.weight_bytes, checkpoint)]
    ratios = {name: predicted / engine for name, predicted, engine in rows}
    ok = all(abs(r - 1) <= TOLERANCE for r in ratios.values())
    report = Report(f"kvtier plan --measure — {model}", data={
        "kv_bytes": plan.gpu.kv_bytes, "block_tokens": engine_block, "kv_bytes_per_block":
        plan.model.layout.bytes_per_block(engine_block), "predicted_kv_blocks": plan.gpu.kv_blocks,
        "engine_kv_blocks": engine_blocks, "predicted_weight_bytes": plan.model.weight_bytes,
        "checkpoint_weight_bytes": checkpoint, "ratios": ratios, "tolerance": TOLERANCE, "ok": ok})
    report.add(Table("the plan against vLLM's CPU engine and the checkpoint", ["figure", "plan", "engine / checkpoint",
                                                                                "ratio"],
                     [[n, f"{p:,}", f"{e:,}", f"{p / e:.4f}"] for n, p, e in rows]),
               Text(f"KV budget {plan.gpu.kv_bytes:,} B (kv_cache_memory_bytes), blocks of {engine_block} tokens"),
               Text(f"{'within' if ok else 'NOT within'} {TOLERANCE:.0%}", "bold green" if ok else "bold red"))
    report.print()
    if json_path:
        report.write_json(json_path)
    return 0 if ok else 1


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of every tensor the folder's safetensors files hold, from their headers (no tensor is read)."""
    total = 0
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {folder}: no .safetensors file to check the weights against")
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, tensor in header.items():
            if name != "__metadata__":
                start, end = tensor["data_offsets"]
                total += end - start
    return total


def _engine_blocks(model: str, kv_bytes: int, block_tokens: int, max_model_len: int, max_num_seqs: int,
                   max_batched_tokens: int) -> int:
    """The KV blocks an in-process vLLM on the CPU allocates."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    try:
        from vllm import LLM
    except ImportError as e:
        raise ValueError(f"--measure needs vLLM (its CPU build: `make venv` installs it): {e}") from None

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_model_len,
              block_size=block_tokens, kv_cache_memory_bytes=kv_bytes, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max(max_batched_tokens, max_model_len), seed=0)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    if blocks is None:
        raise RuntimeError("vLLM sized no KV cache")
    return int(blocks)
