"""A tokenizer for the tiny model, built here (nothing is downloaded), so that text clients can drive it as they
drive a real model: `vllm serve`, the OpenAI API, `vllm bench serve`, chat clients.

Any text encodes to ids that decode back to exactly that text, so distinct texts get distinct ids and a prefix
cache hits only where two texts really share a prefix: as a byte-level BPE does, with whole words where it
knows them and bytes where it does not. The vocabulary: the special tokens (ids 0-3, where the tiny model's
config expects them), the 256 bytes (`<0x00>` ... `<0xFF>`, for any character it has no token for), the
printable ASCII characters, then seeded pseudo-words, each with and without a leading space, the same on every
machine. A text splits as GPT-2's does (a word with its leading space, a digit, a run of punctuation, spaces),
and a piece is one token when the vocabulary has it, else one per character (or byte).

Any sequence of the spaced words' ids (`WORDS`) decodes to text that encodes back to the same ids: what
`vllm bench serve` needs from its random datasets, which decode random ids to text and send the text.
"""

from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1 (bos), 2 (eos), 3
VOCAB = 32_000  # the tiny model's vocabulary
BYTES = range(len(SPECIALS), len(SPECIALS) + 256)  # `<0xNN>`: any byte of a character with no token of its own
CHARACTERS = [chr(c) for c in range(32, 127)]  # the printable ASCII characters, one token each
FIRST_WORD = BYTES.stop + len(CHARACTERS)
WORDS = range(FIRST_WORD + 1, VOCAB, 2)  # " word": a pseudo-word with its leading space
PIECES = r" ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+"  # GPT-2's split, without its contractions
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} : {{ message['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %}<s> assistant :{% endif %}"
)


def pseudo_words(n: int, seed: int = 0) -> list[str]:
    """`n` distinct lowercase pseudo-words, the same for a seed on every machine; the chat template's words first."""
    rng = random.Random(seed)
    words = ["user", "assistant", "system"]
    seen = set(words)
    while len(words) < n:
        word = "".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def vocabulary(seed: int = 0) -> dict[str, int]:
    """Every token and its id (module docstring): each pseudo-word bare, then with its leading space (`WORDS`)."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + CHARACTERS
    for word in pseudo_words(-(-(VOCAB - len(tokens)) // 2), seed):
        tokens += [word, " " + word]
    return {token: i for i, token in enumerate(tokens[:VOCAB])}


def build_tokenizer(path: str | Path, seed: int = 0) -> str:
    """Build the tokenizer and save it (with the chat template) into `path`, next to the model's weights."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(seed)
    # No merges: a piece the vocabulary holds whole is one token (ignore_merges), any other is split into
    # characters, and a character it lacks into its UTF-8 bytes (byte_fallback). Decoding joins the tokens as
    # they are: the spaces are in them.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                                     ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return str(path)
