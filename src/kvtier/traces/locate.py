"""Where the public traces are: the folder $KVTIER_TRACES_DIR names, nothing searched for. Its files keep the
names below (their sources' own, in a folder per source); a missing variable or file is an error that says where
to download it. Any command that takes a trace also takes a path: the folder is only for the benchmarks' defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "KVTIER_TRACES_DIR"
_MOONCAKE = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/3cca71daccf2a7afb8fe3f0295358f70e3a69fdb/"
             "FAST25-release/traces/")
_AZURE = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/790921015d50dd6aae7f7e47f39ba0e235ad6b08/data/"
SOURCES = {  # a file of the folder -> where it is published
    "mooncake/conversation_trace.jsonl": _MOONCAKE + "conversation_trace.jsonl",
    "mooncake/synthetic_trace.jsonl": _MOONCAKE + "synthetic_trace.jsonl",
    "azure_llm_2023/AzureLLMInferenceTrace_code.csv": _AZURE + "AzureLLMInferenceTrace_code.csv",
    "azure_llm_2023/AzureLLMInferenceTrace_conv.csv": _AZURE + "AzureLLMInferenceTrace_conv.csv",
}


def traces_dir() -> Path:
    """The folder $KVTIER_TRACES_DIR names; FileNotFoundError, saying what to put in one, when it is unset."""
    folder = os.environ.get(ENV)
    if not folder:
        wanted = "; ".join(f"{name} from {url}" for name, url in SOURCES.items())
        raise FileNotFoundError(f"set {ENV} to the folder of the public traces, downloaded there as: {wanted}")
    return Path(folder)


def public_trace(name: str) -> Path:
    """The file `name` of the traces' folder (e.g. "mooncake/conversation_trace.jsonl"); FileNotFoundError, saying
    where to download it, when it is not there."""
    path = traces_dir() / name
    if not path.is_file():
        where = f"; download it from {SOURCES[name]}" if name in SOURCES else ""
        raise FileNotFoundError(f"{path}: no such file in ${ENV}{where}")
    return path
