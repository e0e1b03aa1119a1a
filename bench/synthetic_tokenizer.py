"""A synthetic byte-level BPE tokenizer.json of any vocabulary size, for benchmarks where no real tokenizer of
that size is on the machine (Qwen3's 151,936 tokens, offline). Its tokens look like a real vocabulary's: the
256 bytes, JSON punctuation, numbers, words with and without a leading space or a capital, and CJK
characters; one EOS special token. It has no merges, so it encodes text byte by byte: llguidance builds its
masks from the tokens themselves and tokenizes greedily, which is all the benchmarks need.
"""
from __future__ import annotations

import json
import os
import random

PUNCTUATION = ['{"', '":', '": "', '", "', '"}', '},', '}]', '],', ', "', ': ', ', ', '"', ' "', '[{', '{', '}',
               '[', ']', ':', ',', '.', '-', '@', '_', '\n', '  ', '    ', '\t', '": [', '": {', '"},', '" ', 'null',
               'true', 'false', ' null', ' true', ' false']
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
WEIGHTS = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0, 1.9, 1.5,
           1.0, 0.8, 0.2, 0.2, 0.1, 0.1]


def byte_level_alphabet() -> dict[int, str]:
    """The byte-level pre-tokenizer's map from each byte to a printable character (GPT-2's scheme)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def token_texts(count: int, seed: int = 0) -> list[str]:
    """count distinct token texts (not counting the 256 single bytes), the common ones first."""
    rng = random.Random(seed)
    seen: set[str] = set()
    texts: list[str] = []

    def add(text: str) -> None:
        if len(texts) < count and text not in seen and len(text.encode()) > 1:
            seen.add(text)
            texts.append(text)

    for p in PUNCTUATION:
        add(p)
    for n in range(1000):
        add(str(n))
        add(f" {n}")
    while len(texts) < count:
        kind = rng.random()
        if kind < 0.08:  # CJK: one or two characters
            add("".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2))))
            continue
        word = "".join(rng.choices(LETTERS, WEIGHTS, k=rng.randint(2, 12)))
        for variant in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            add(variant)
    return texts


def write_synthetic_tokenizer(directory: str, vocab_size: int, eos_token_id: int) -> str:
    """Write directory/tokenizer.json with exactly vocab_size ids, eos_token_id being <|im_end|>; returns
    the directory."""
    alphabet = byte_level_alphabet()
    encode = lambda text: "".join(alphabet[b] for b in text.encode())  # noqa: E731
    vocab = {alphabet[b]: b for b in range(256)}
    ids = [i for i in range(256, vocab_size) if i != eos_token_id]
    for token_id, text in zip(ids, token_texts(len(ids))):
        vocab[encode(text)] = token_id
    eos = "<|im_end|>"
    vocab[eos] = eos_token_id
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": eos_token_id, "content": eos, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []},
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(spec, f, ensure_ascii=False)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos}, f)
    return directory
