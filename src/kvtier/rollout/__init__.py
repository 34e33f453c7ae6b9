"""`kvtier rollout`: the seven-step method against a real OpenAI-compatible server (`run` has the steps)."""
