"""Trace readers: the real Mooncake and Azure files as published, the kvtier format, and malformed lines.

Every malformed-line case checks the error names the file, the 1-based line and the field, and that the
requests before the bad line were already streamed out (the reader never loads the file first).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest

from kvtier.keys import chain_keys
from kvtier.traces.azure import SyntheticReuse, read_azure
from kvtier.traces.kvtier_jsonl import read_kvtier_jsonl
from kvtier.traces.locate import ENV, SOURCES, public_trace, traces_dir
from kvtier.traces.mooncake import read_mooncake
from kvtier.traces.read import read_trace, trace_format
from kvtier.traces.request import TraceError, TraceRequest
from tests.conftest import PUBLIC_TRACES

DATA = Path(__file__).parent / "data" / "traces"
SHARED = PUBLIC_TRACES
MOONCAKE = SHARED / "mooncake"
AZURE = SHARED / "azure_llm_2023"


def test_the_public_traces_are_in_the_folder_the_variable_names_and_a_missing_one_says_where_to_get_it(
        monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=f"set {ENV} to the folder of the public traces") as unset:
        traces_dir()
    assert all(url in str(unset.value) for url in SOURCES.values())
    monkeypatch.setenv(ENV, str(tmp_path))
    name = "mooncake/conversation_trace.jsonl"
    with pytest.raises(FileNotFoundError, match=f"download it from {SOURCES[name]}"):
        public_trace(name)
    (tmp_path / "mooncake").mkdir()
    (tmp_path / name).write_text("")
    assert traces_dir() == tmp_path and public_trace(name) == tmp_path / name


# ---------------------------------------------------------------- Mooncake


def test_mooncake_small_file_is_read_field_by_field() -> None:
    requests = list(read_mooncake(DATA / "mooncake_small.jsonl"))
    assert requests == [
        TraceRequest(0.0, (0, 1, 2), 1100, 20, 512),
        TraceRequest(1.5, (0, 3), 600, 5, 512),  # ms -> s; sparse ids interned in order of first appearance
        TraceRequest(3.0, (0, 1, 2), 1536, 0, 512),  # the blank line before it is skipped
    ]


# Rows, total ids, distinct ids, span (ms) and mean input/output from the traces' README and the paper's Table 2.
MOONCAKE_STATS = {
    "conversation": (12_031, 288_500, 182_790, 3_536_999, 12_035, 343),
    "synthetic": (3_993, 121_877, 43_924, 1_022_025, 15_325, 149),
}


@pytest.mark.parametrize("name", sorted(MOONCAKE_STATS))
def test_mooncake_traces_match_their_published_statistics(name: str) -> None:
    rows, total, distinct, span_ms, mean_in, mean_out = MOONCAKE_STATS[name]
    requests = read_mooncake(MOONCAKE / f"{name}_trace.jsonl")
    assert inspect.isgenerator(requests)
    n = blocks = top = tokens_in = tokens_out = 0
    last = 0.0
    for r in requests:
        assert len(r.blocks) == math.ceil(r.input_tokens / 512) and r.block_tokens == 512
        assert r.timestamp >= last
        last = r.timestamp
        n += 1
        blocks += len(r.blocks)
        top = max(top, *r.blocks)
        tokens_in += r.input_tokens
        tokens_out += r.output_tokens
    assert (n, blocks, top + 1) == (rows, total, distinct)  # dense ids: the largest is the count minus one
    assert last == span_ms / 1000
    assert round(tokens_in / n) == mean_in and round(tokens_out / n) == mean_out


# ---------------------------------------------------------------- kvtier JSONL


def test_kvtier_tokens_become_chained_blocks_and_keys_are_taken_as_given() -> None:
    requests = list(read_kvtier_jsonl(DATA / "kvtier_small.jsonl", block_tokens=4))
    a, b, c, d = requests
    # 10 tokens in blocks of 4: two full blocks and a partial one; the 9-token request shares the two full ones
    assert a == TraceRequest(0.0, (0, 1, 2), 10, 3, 4, session="s1", tenant="acme", priority=80)
    assert b == TraceRequest(0.5, (0, 1, 3), 9, 0, 4, session="7")
    # hex strings and ints name the same keys; input_length defaults to len(keys) * block_tokens
    assert c == TraceRequest(1.25, (4, 5), 20, 0, 16)
    assert d == TraceRequest(2.0, (4, 5, 6), 48, 0, 16)


def test_kvtier_blocks_follow_the_runtime_keys(tmp_path) -> None:
    """Two requests share a block exactly when the runtime's chained keys agree, the partial tail included."""
    tokens = list(range(40))
    assert chain_keys(tokens[:8], 4) == chain_keys(tokens, 4)[:2]  # the premise: full blocks are chained
    lines = [tokens, tokens[:8] + [7, 7], tokens[:10], tokens[:9] + [0], tokens[:10], [4, 5, 6, 7] + tokens[4:8]]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": 0, "tokens": {t}}}\n' for t in lines))
    blocks = [r.blocks for r in read_kvtier_jsonl(trace, block_tokens=4)]
    assert blocks[0] == tuple(range(10))
    assert blocks[1] == (0, 1, 10)  # same first 8 tokens, different tail
    assert blocks[2] == (0, 1, 11)  # the 2-token tail [8, 9] is not the full block [8, 9, 10, 11]
    assert blocks[3] == (0, 1, 12)
    assert blocks[4] == blocks[2]  # the same partial tail after the same prefix is the same block
    assert blocks[5] == (13, 14)  # the same 4 tokens after another prefix are another block


# ---------------------------------------------------------------- Azure + synthetic reuse


def test_azure_rows_become_requests_under_the_reuse_model() -> None:
    model = SyntheticReuse(prefixes=1, prefix_tokens=512, share=1.0, block_tokens=256)
    a, b, c = read_azure(DATA / "azure_small.csv", model)
    assert (a.timestamp, a.input_tokens, a.output_tokens, a.block_tokens) == (0.0, 1000, 20, 256)
    assert b.timestamp == pytest.approx(0.5) and c.timestamp == pytest.approx(3.31941)
    assert a.blocks == (0, 1, 2, 3)  # 2 shared prefix blocks, then 2 unique ones (the last partial)
    assert b.blocks == (0, 4)  # 300 tokens: one full block of the prefix, then its own partial block
    assert c.blocks == ()


def test_synthetic_reuse_is_seeded_and_does_what_it_says() -> None:
    path = AZURE / "AzureLLMInferenceTrace_conv.csv"
    model = SyntheticReuse(prefixes=8, prefix_tokens=512, share=0.3, block_tokens=128, seed=3)
    first = list(read_azure(path, model))
    assert first == list(read_azure(path, model))  # same seed, same blocks
    assert first != list(read_azure(path, SyntheticReuse(**{**model.__dict__, "seed": 4})))
    uses: dict[int, int] = {}
    for r in first:
        assert len(r.blocks) == math.ceil(r.input_tokens / 128)
        for b in r.blocks:
            uses[b] = uses.get(b, 0) + 1
    assert sum(n > 1 for n in uses.values()) <= 8 * 4  # nothing but the 8 prefixes of 4 blocks ever repeats
    long_enough = [r for r in first if r.input_tokens >= 128]  # carriers of a prefix start with a shared block
    carrying = sum(uses[r.blocks[0]] > 1 for r in long_enough) / len(long_enough)
    assert abs(carrying - 0.3) < 0.02
    assert "30% of requests" in model.describe()
    none = list(read_azure(path, SyntheticReuse(share=0.0)))
    assert len({b for r in none for b in r.blocks}) == sum(len(r.blocks) for r in none)  # no reuse at all


def test_synthetic_reuse_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="share"):
        SyntheticReuse(share=1.5)
    with pytest.raises(ValueError, match="block_tokens"):
        SyntheticReuse(block_tokens=0)


# ---------------------------------------------------------------- format detection


def test_read_trace_recognises_each_format() -> None:
    assert trace_format(DATA / "mooncake_small.jsonl") == "mooncake"
    assert trace_format(DATA / "kvtier_small.jsonl") == "kvtier"
    assert trace_format(DATA / "azure_small.csv") == "azure"
    assert list(read_trace(DATA / "mooncake_small.jsonl")) == list(read_mooncake(DATA / "mooncake_small.jsonl"))
    assert [r.block_tokens for r in read_trace(DATA / "kvtier_small.jsonl")] == [256, 256, 16, 16]
    assert [r.block_tokens for r in read_trace(DATA / "azure_small.csv", block_tokens=64)] == [64, 64, 64]
    with pytest.raises(ValueError, match="512"):
        read_trace(DATA / "mooncake_small.jsonl", block_tokens=256)
    with pytest.raises(ValueError, match="length-only"):
        read_trace(DATA / "kvtier_small.jsonl", reuse=SyntheticReuse())


# ---------------------------------------------------------------- malformed lines

GOOD_MOONCAKE = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
GOOD_KVTIER = '{"timestamp": 0, "tokens": [1, 2, 3]}\n'
AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,1000,20\n"

# (file name, two good lines before the bad one, the bad line, the field the error must name)
MALFORMED = [
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 0, "hash_ids": [1, 2]', "<line>"),  # bad JSON
    ("m.jsonl", GOOD_MOONCAKE, "[1, 2, 3]", "<line>"),
    ("m.jsonl", GOOD_MOONCAKE, '{"input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": -3, "input_length": 5, "hash_ids": [1]}', "timestamp"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": "0", "input_length": 5, "hash_ids": [1]}', "timestamp"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": 5, "hash_ids": [1, "2"]}', "hash_ids"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": 5, "hash_ids": [1, 2.5]}', "hash_ids"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": 5, "hash_ids": [true]}', "hash_ids"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": 5, "hash_ids": []}', "hash_ids"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": 5, "hash_ids": 4}', "hash_ids"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": -5, "hash_ids": [1]}', "input_length"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "input_length": 5.5, "hash_ids": [1]}', "input_length"),
    ("m.jsonl", GOOD_MOONCAKE, '{"timestamp": 9, "hash_ids": [1]}', "input_length"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["0a", "0b"]}', "block_tokens"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["0a"], "block_tokens": 0}', "block_tokens"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["0a", "zz"], "block_tokens": 4}', "keys"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["-1"], "block_tokens": 4}', "keys"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["0a", "abc"], "block_tokens": 4}', "keys"),  # odd length
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["0x0a"], "block_tokens": 4}', "keys"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": ["f_f"], "block_tokens": 4}', "keys"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "keys": [], "block_tokens": 4}', "keys"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": [1], "keys": ["0a"], "block_tokens": 4}', "keys"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": [1, -2]}', "tokens"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": [1, "a"]}', "tokens"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": []}', "tokens"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": "abc"}', "tokens"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": [1], "priority": 101}', "priority"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": [1], "session": [1]}', "session"),
    ("k.jsonl", GOOD_KVTIER, '{"timestamp": 1, "tokens": [1], "output_length": -1}', "output_length"),
    ("k.jsonl", GOOD_KVTIER, '{"tokens": [1]}', "timestamp"),
    ("a.csv", AZURE_ROW, "2023-11-16 18:15:47.0000000,12x,20", "ContextTokens"),
    ("a.csv", AZURE_ROW, "2023-11-16 18:15:47.0000000,12,-20", "GeneratedTokens"),
    ("a.csv", AZURE_ROW, "yesterday,12,20", "TIMESTAMP"),
    ("a.csv", AZURE_ROW, "2023-11-16 18:15:40.0000000,12,20", "TIMESTAMP"),  # before the first row
    ("a.csv", AZURE_ROW, "2023-11-16 18:15:47.0000000,12", "<row>"),
]


@pytest.mark.parametrize(("name", "good", "bad", "field"), MALFORMED)
def test_a_malformed_line_names_file_line_and_field(tmp_path, name: str, good: str, bad: str, field: str) -> None:
    path = tmp_path / name
    head = AZURE_HEAD if name.endswith(".csv") else ""
    path.write_text(head + good + "\n" + good + bad + "\n" + good)  # a blank line counts as a line
    bad_line = 4 + bool(head)
    requests = read_trace(path)
    next(requests), next(requests)  # the good lines before it are streamed first
    with pytest.raises(TraceError) as caught:
        next(requests)
    error = caught.value
    assert (error.line, error.field) == (bad_line, field)
    assert str(error).startswith(f"{path}:{bad_line}: field '{field}': ")


def test_a_kvtier_trace_out_of_arrival_order_is_refused_at_the_first_late_line(tmp_path) -> None:
    """Found by reading: a kvtier JSONL trace with timestamps out of order was accepted, and replayed in file order.
    Equal timestamps are in order."""
    path = tmp_path / "k.jsonl"
    path.write_text("".join(f'{{"timestamp": {t}, "tokens": [1, 2, 3]}}\n' for t in (0, 2, 2, 1.5, 3)))
    requests = read_trace(path)
    assert [next(requests).timestamp for _ in range(3)] == [0, 2, 2]
    with pytest.raises(TraceError) as caught:
        next(requests)
    assert (caught.value.line, caught.value.field) == (4, "timestamp")
    assert "1.5 is earlier than line 3's 2" in str(caught.value)


def test_a_csv_without_a_needed_column_names_it_on_line_1(tmp_path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens\n" + AZURE_ROW)
    with pytest.raises(TraceError, match=r"a\.csv:1: field 'GeneratedTokens'"):
        list(read_trace(path))


def test_a_jsonl_line_of_no_known_format_is_named(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('\n{"timestamp": 0, "prompt": "hi"}\n')
    with pytest.raises(TraceError, match=r"x\.jsonl:2: field 'hash_ids'"):
        read_trace(path)


# ---------------------------------------------------------------- kv-cache-tester agentic traces

AGENTIC = DATA / "agentic"


def test_agentic_conversations_become_chained_requests_with_their_subagents() -> None:
    assert trace_format(AGENTIC) == trace_format(AGENTIC / "coder-1.json") == "agentic"
    requests = list(read_trace(AGENTIC))
    assert [r.timestamp for r in requests] == [0.0, 1.0, 1.5, 2.0, 3.1, 4.0, 4.5, 5.0, 6.0, 8.0, 9.0]  # all merged
    assert [r.session for r in requests][:5] == ["coder-1", "coder-2", "coder-3", "coder-1", "coder-1::explore-1"]
    first, second, sub = requests[0], requests[3], requests[4]
    assert (first.input_tokens, first.output_tokens, first.block_tokens) == (20 * 64 + 37, 120, 64)
    assert second.blocks[:20] == first.blocks  # the next turn extends the same prefix
    assert sub.blocks[:16] == first.blocks[:16] and sub.blocks[16] not in first.blocks  # same system prompt
    other = requests[1]
    assert not set(other.blocks) & set(first.blocks), "'local' ids: the same id in another conversation is not shared"


def test_agentic_ids_are_content_so_blocks_are_interned_by_prefix(tmp_path) -> None:
    conv = {"id": "x", "block_size": 16, "hash_id_scope": "global",
            "requests": [{"t": 0, "in": 32, "hash_ids": [1, 2]}, {"t": 1, "in": 32, "hash_ids": [3, 2]}]}
    (tmp_path / "a.json").write_text(__import__("json").dumps(conv))
    (tmp_path / "b.json").write_text(__import__("json").dumps({**conv, "id": "y"}))
    a1, b1, a2, b2 = list(read_trace(tmp_path))
    assert a1.blocks[1] != a2.blocks[1], "block 2 after 1 is not block 2 after 3"
    assert a1.blocks == b1.blocks, "'global' ids: the same ids in another conversation are the same blocks"
    with pytest.raises(ValueError, match="64 tokens"):
        read_trace(AGENTIC, block_tokens=256)


@pytest.mark.parametrize("change, field", [
    ({"block_size": 0}, "block_size"), ({"hash_id_scope": "galaxy"}, "hash_id_scope"),
    ({"requests": {"t": 0}}, "requests"), ({"requests": [{"t": -1, "in": 5, "hash_ids": []}]}, "requests[0].t"),
    ({"requests": [{"t": 0, "in": 5, "hash_ids": ["a"]}]}, "requests[0].hash_ids"),
    ({"requests": [{"t": 0, "hash_ids": [1]}]}, "requests[0].in"),
    ({"requests": [{"t": 0, "type": "subagent", "requests": [{"t": 1, "in": "x", "hash_ids": [1]}]}]},
     "requests[0].requests[0].in"),
])
def test_a_malformed_agentic_trace_names_file_and_field(tmp_path, change: dict, field: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(__import__("json").dumps({"id": "x", "block_size": 64, "requests": [], **change}))
    with pytest.raises(TraceError) as e:
        list(read_trace(path))
    assert e.value.field == field and "bad.json" in str(e.value)
