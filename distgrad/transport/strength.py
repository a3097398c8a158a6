"""A rough estimate of how many guesses a cluster secret resists.

Two ways to count, and the secret gets the smaller:

- as *characters*: its length times log2 of the size of the character classes
  it uses (lowercase, uppercase, digits, anything else);
- as *words*: split into runs of letters (a capital starts a new run), digits
  and other characters. A run of three letters or more that reads like words
  (enough vowels, no cluster of five consonants) costs a guesser one word of a large dictionary
  (:data:`WORD_BITS`) per :data:`WORD_LETTERS` letters, at least one, plus a bit
  when capitalised, or its characters if that is less. Every other character
  costs what it costs counted as characters, except a separator that appears
  again (``-`` between every word is one choice, not four).

The word count needs no dictionary: it errs towards calling a run words, which
at worst draws a warning for a secret that was fine. Random secrets are hardly
touched: few of their runs read as words, and a long random run of letters
that does is still counted at 2.8 bits a letter (a word of 17 bits per 6).
The word count applies only when such runs make up half the secret or more.

Example::

    >>> secret_bits(b"correct-horse-battery-staple-xyz") < 128     # words, not 32 characters
    True
    >>> secret_bits(b"0f3a" * 16) >= 128                            # secrets.token_hex(32)
    True
"""
from __future__ import annotations

import math
import re
import string

WORD_BITS = math.log2(100_000)   # a guesser's dictionary: some 100,000 words
WORD_LETTERS = 6                 # letters per word, rounded: a long run is several words
_TOKENS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+|[^A-Za-z0-9]+")
_CONSONANTS = re.compile(r"[^aeiouy]{5,}")


def char_bits(text: str) -> float:
    """``text``'s length times log2 of the size of the character classes it uses."""
    size = sum(n for chars, n in ((string.ascii_lowercase, 26), (string.ascii_uppercase, 26),
                                  (string.digits, 10)) if any(c in chars for c in text))
    size += 33 if any(not c.isalnum() or not c.isascii() for c in text) else 0
    return len(text) * math.log2(max(size, 2))


def reads_as_words(letters: str) -> bool:
    """Whether a run of ASCII letters could be one word or several run together."""
    low = letters.lower()
    vowels = sum(c in "aeiou" for c in low) + 0.5 * low.count("y")
    return len(low) >= 3 and vowels >= 0.28 * len(low) and not _CONSONANTS.search(low)


def word_bits(text: str) -> float:
    """``text`` counted as words, digits and separators (see the module docstring)."""
    per_char = char_bits(text) / len(text) if text else 0.0
    bits, seen, in_words = 0.0, set(), 0
    for m in _TOKENS.finditer(text):
        tok = m.group()
        chars = len(tok) * per_char
        if tok.isalpha() and tok.isascii() and reads_as_words(tok):
            in_words += len(tok)
            words = max(1, round(len(tok) / WORD_LETTERS))
            bits += min(chars, words * WORD_BITS + (1.0 if tok[0].isupper() else 0.0))
        elif not tok.isalnum() and tok in seen:
            continue   # a separator used again: no new choice
        else:
            seen.add(tok)
            bits += chars
    # a few word-like runs in a random string (``Gupo`` in a token_urlsafe) are chance
    return bits if 2 * in_words >= len(text) else char_bits(text)


def secret_bits(secret: bytes) -> float:
    """A rough upper bound on the entropy of ``secret``: the smaller of its count as
    characters and as words (see the module docstring); bytes that are not UTF-8
    count 8 bits each."""
    try:
        text = secret.decode()
    except UnicodeDecodeError:
        return 8.0 * len(secret)
    return min(char_bits(text), word_bits(text))
