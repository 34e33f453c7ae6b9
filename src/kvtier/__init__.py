"""kvtier: tiered KV-cache offloading for LLM serving.

The metadata plane (config, keys, layout, directory, policies) imports neither torch nor vLLM;
the data plane (stores, mover, cache) imports torch.
"""

__version__ = "0.1.0"
FORMAT_VERSION = 2  # on-disk / shared-store block format; part of every namespace (2: the header has a MAC)
