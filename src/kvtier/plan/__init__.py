"""`kvtier plan`: split the memory budget (weights, workspace, engine KV, then host and disk tiers) before anything
is offloaded. Metadata only: no torch, no vLLM (`kvtier.integrations.vllm.measure_plan` checks a plan on the engine)."""
