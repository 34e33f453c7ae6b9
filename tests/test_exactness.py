"""The rollout's exactness check compares a request with the reference only when its cached KV has the same
lineage: vLLM's own cache hit on a block that another prefill computed may differ in the last bits."""

from __future__ import annotations

from kvtier.rollout.exactness import check, lineage

BLOCK = 4
SHARED = [1, 2, 3, 4, 5, 6, 7, 8]  # two blocks
PROMPTS = [SHARED + [9, 9, 9, 9, 9], SHARED + [10, 10, 10, 10, 10], SHARED + [11, 11, 11, 11, 11]]


def results(cached: list[int], logprobs: list[float] | None = None) -> list[dict]:
    logprobs = logprobs or [-1.0] * len(cached)
    return [{"cached": c, "tokens": ["x"], "logprobs": [lp]} for c, lp in zip(cached, logprobs)]


def test_the_same_history_is_compared_request_by_request():
    reference = results([0, 8, 8])
    assert check(reference, results([0, 8, 8]), PROMPTS, BLOCK) == {
        "compared": 3, "identical": 3, "exact": True, "max_logprob_diff": 0.0, "others": 0, "others_same_tokens": 0,
        "others_same_cached": 0}
    changed = check(reference, results([0, 8, 8], [-1.0, -1.0, -1.5]), PROMPTS, BLOCK)
    assert (changed["compared"], changed["identical"], changed["exact"]) == (3, 2, False)
    assert changed["max_logprob_diff"] == 0.5


def test_a_block_recomputed_by_another_prompt_is_not_the_reference_s_hit():
    """The second request found nothing (its engine lost the shared blocks) and computed them again, inside
    its own prompt: the third request's hit has the reference's length, but not its KV."""
    report = check(results([0, 8, 8]), results([0, 0, 8], [-1.0, -1.2, -1.3]), PROMPTS, BLOCK)
    assert (report["compared"], report["identical"], report["exact"]) == (1, 1, True)
    assert (report["others"], report["others_same_cached"]) == (2, 1)


def test_a_block_computed_twice_has_no_lineage():
    twice = lineage(results([0, 0, 8]), PROMPTS, BLOCK)
    assert twice[0] is not None and twice[1] is not None and twice[2] is None
    fresh = lineage(results([0, 8, 8]), PROMPTS, BLOCK)
    assert fresh[0] == twice[0] and fresh[1] != twice[1]
    assert lineage(results([4]), [[20, 21, 22, 23, 24]], BLOCK) == [None]  # a hit on a block no request computed
