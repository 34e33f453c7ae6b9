"""A tokenizer for the tiny model, trained here (nothing is downloaded), so that text clients can drive it:
`vllm serve`, the OpenAI API, `vllm bench serve`.

A word-level vocabulary of pseudo-words drawn from a seeded generator: the same words, ids and files on every
machine. Any sequence of its ids decodes to words separated by spaces and encodes back to the same ids, which
is what `vllm bench serve` needs from its random and prefix-repetition datasets (they decode random ids to text
and send the text). Ids 0-3 are the special tokens, in the places the tiny model's config expects them.
"""

from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1 (bos), 2 (eos), 3
VOCAB = 32_000  # the tiny model's vocabulary: every id it can generate decodes to a word
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def pseudo_words(n: int, seed: int = 0) -> list[str]:
    """`n` distinct lowercase pseudo-words, the same for a seed on every machine."""
    rng = random.Random(seed)
    words: list[str] = []
    seen = set(SPECIALS) | {"user", "assistant", "system", ":"}
    words += ["user", "assistant", "system", ":"]  # what the chat template writes
    while len(words) < n:
        word = "".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def build_tokenizer(path: str | Path, vocab: int = VOCAB, seed: int = 0) -> str:
    """Train the word-level tokenizer on a corpus of its own words and save it (with the chat template) into
    `path`, next to the model's weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = pseudo_words(vocab - len(SPECIALS), seed)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=SPECIALS, min_frequency=1)
    tokenizer.train_from_iterator([" ".join(words)], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return str(path)
