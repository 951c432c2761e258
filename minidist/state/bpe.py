"""Byte-pair encoding's training loop in one screen, for readers (Sennrich et al. 2016).

The tokenizer minidist trains is Hugging Face's (:mod:`minidist.state.tokenizer`, in Rust and
fast); this is the same algorithm written plainly, and tests check that both learn the same
merges on a small corpus.  Slow (every step recounts every pair): read it, don't train with it.

    vocabulary = the 256 byte tokens; words = the corpus cut into words, each a list of tokens
    repeat until the vocabulary is full:
        count every adjacent pair of tokens inside the words (weighted by the word's count)
        take the most frequent pair (a tie goes to the smallest token ids, as the library does)
        add a + b to the vocabulary, and replace every occurrence of (a, b), left to right
"""

from __future__ import annotations

from collections import Counter

from minidist.state.tokenizer import byte_chars, new_tokenizer, text_pieces


def word_counts(data: bytes) -> Counter:
    """How often each word occurs, cut as the library cuts them (GPT-2's pattern on the bytes'
    stand-in characters, the same text pieces)."""
    cut = new_tokenizer().pre_tokenizer.pre_tokenize_str
    return Counter(word for is_text, text in text_pieces(data) if is_text for word, _ in cut(text))


def learn_merges(words: dict, vocab_size: int) -> list[tuple[str, str]]:
    """The merges, in order, that grow the byte alphabet to ``vocab_size`` tokens on ``words``
    (``{word: count}``); fewer if no pair is left."""
    names = sorted(byte_chars())  # token id -> token; the bytes numbered in character order
    ids = {name: i for i, name in enumerate(names)}
    seqs, counts = [[ids[c] for c in w] for w in words], list(words.values())
    merges = []
    while len(names) < vocab_size:
        pairs = Counter()
        for seq, n in zip(seqs, counts):
            for pair in zip(seq, seq[1:]):
                pairs[pair] += n
        if not pairs:
            break
        a, b = max(pairs, key=lambda p: (pairs[p], -p[0], -p[1]))
        merges.append((names[a], names[b]))
        new = ids.setdefault(names[a] + names[b], len(names))
        if new == len(names):
            names.append(names[a] + names[b])
        seqs = [merge(seq, (a, b), new) for seq in seqs]
    return merges


def merge(seq: list, pair: tuple, new: int) -> list:
    """``seq`` with every occurrence of ``pair`` replaced by ``new``, left to right."""
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out
