"""`kvtier rollout`: the seven-step method against a real OpenAI-compatible server (`run` starts it, `steps` has
the steps)."""
