"""The tiny model's tokenizer tokenizes any text as a real model's does: distinct texts get distinct ids (none of
them `<unk>`), any text comes back from its ids, and word-id sequences come back from their text."""

from __future__ import annotations

import random

import pytest

from kvtier.integrations.vllm.tiny_tokenizer import SPECIALS, VOCAB, WORDS, build_tokenizer

TEXTS = [
    "For user 1, here are some other context: hi hi hi",
    "For user 2, here are some other context: hi hi hi",
    "Hello world, the quick brown fox",
    "Hello world, the quick brown fox!",
    "hello world, the quick brown fox",
    "3.14159 != 2.71828; (a+b)*c = 42?",
    "3.14159 != 2.71828; (a+b)*c = 43?",
    "naïve café — 東京 🙂",
    "tabs\tand\nnewlines  and   spaces",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_every_id_of_the_model_has_a_token(tokenizer):
    assert len(tokenizer) == VOCAB
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(len(SPECIALS))] == SPECIALS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_distinct_texts_get_distinct_ids_and_come_back_exactly(tokenizer):
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({tuple(ids) for ids in encoded}) == len(TEXTS)
    for text, ids in zip(TEXTS, encoded):
        assert tokenizer.unk_token_id not in ids, text
        assert tokenizer.decode(ids) == text
    first, second = encoded[:2]  # "For user 1" and "For user 2": the same ids up to the digit, no further
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert tokenizer.decode(first[:shared]) == "For user "


def test_word_id_sequences_come_back_from_their_text(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice(WORDS) for _ in range(rng.randint(1, 400))]
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_the_chat_template_frames_each_message(tokenizer):
    messages = [{"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s> user : hi there </s><s> assistant :"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.eos_token_id) == 1
