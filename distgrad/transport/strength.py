"""A rough estimate of how many guesses a cluster secret resists.

Two ways to count, and the secret gets the smaller:

- as *characters*: its length times log2 of the size of the character classes
  it uses (lowercase, uppercase, digits, anything else);
- as *words*: split into runs of letters (a capital starts a new run), digits
  and other characters. A run of three letters or more that reads like words
  (enough vowels, no cluster of six consonants; or, whatever its letters, one
  between separators that recur, as in a diceware phrase) costs a guesser one word of a large dictionary
  (:data:`WORD_BITS`) per :data:`WORD_LETTERS` letters, at least one, plus a bit
  when capitalised, or its characters if that is less. Every other character
  costs what it costs counted as characters, except a separator that appears
  again (``-`` between every word is one choice, not four).

- as *repetition*: read left to right, a stretch that repeats one before it (a
  unit said again, ``password`` * 8, a keyboard walk typed three times), or one of
  the sequences a guesser tries first (the alphabet, digits or keyboard rows in
  order or backwards, counting 1 2 3 ..., digits of pi or e), costs a
  back-reference (where and how long: some 2 log2 n bits), not its characters,
  as a compressor with a preset dictionary would count it (an LZ77 parse; bytes
  that are not UTF-8 too).

Letters are Unicode letters: a run in another script (``пароль``, ``Grüße``)
counts as words without the vowel test, which knows English only.

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
import zlib
from collections import Counter

WORD_BITS = math.log2(100_000)   # a guesser's dictionary: some 100,000 words
WORD_LETTERS = 6                 # letters per word, rounded: a long run is several words
# letters (any script; a capital starts a new run), digits, everything else
_TOKENS = re.compile(r"[^\W\d_a-z]?[^\W\d_A-Z]+|[^\W\d_a-z]+(?![^\W\d_A-Z])|[0-9]+|[\W_]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
_CONSONANTS = re.compile(r"[^aeiouy]{6,}")   # ("strengths", "twelfths": five are words)
_MIN_MATCH = 4        # a repeat shorter than this is chance in a random secret
_LZ_LIMIT = 1 << 16   # characters the parse looks at; longer secrets: deflate's count
_CHAIN = 64           # earlier starts of a repeat tried (most recent first), as zlib bounds it
_MARGIN = 8.0         # bits a back-reference must save to be taken


def char_bits(text: str) -> float:
    """``text``'s length times log2 of the size of the character classes it uses."""
    size = sum(n for chars, n in ((string.ascii_lowercase, 26), (string.ascii_uppercase, 26),
                                  (string.digits, 10)) if any(c in chars for c in text))
    size += 33 if any(not c.isalnum() or not c.isascii() for c in text) else 0
    return len(text) * math.log2(max(size, 2))


def reads_as_words(letters: str) -> bool:
    """Whether a run of ASCII letters could be one word or several run together."""
    low = letters.lower()
    if not low.isascii():
        return len(low) >= 3   # another script: no English vowel test
    vowels = sum(c in "aeiou" for c in low) + 0.5 * low.count("y")
    return len(low) >= 3 and vowels >= 0.28 * len(low) and not _CONSONANTS.search(low)


def word_bits(text: str) -> float:
    """``text`` counted as words, digits and separators (see the module docstring)."""
    per_char = char_bits(text) / len(text) if text else 0.0
    bits, seen, in_words = 0.0, set(), 0
    toks = [m.group() for m in _TOKENS.finditer(text)]
    seps = Counter(t for t in toks if not t.isalnum())
    # words joined by one separator said again (``strengths-twelfths-angsts``, a
    # diceware phrase): each run of letters between them is a word, vowels or not
    joined = {t for t, n in seps.items() if n >= 2}
    for i, tok in enumerate(toks):
        chars = len(tok) * per_char
        between = joined and all(t in joined for t in toks[max(i - 1, 0):i + 2:2] if t != tok)
        if tok.isalpha() and (reads_as_words(tok) or (between and 3 <= len(tok) <= 14)):
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


def _known() -> str:
    """What a guesser tries first, run together (a compressor's preset dictionary):
    the alphabet and digits in order, keyboard rows, counting, digits of pi and e,
    each also backwards; words of a separator so nothing spans two of them."""
    pi = ("3141592653589793238462643383279502884197169399375105820974944592307816406286208998628"
          "0348253421170679821480865132823066470938446095505822317253594081284811174502841027019"
          "38521105559644622948954930381964428810975665933446128475648233786783165271201909145648")
    e = ("2718281828459045235360287471352662497757247093699959574966967627724076630353547594571"
         "38217852516642742746639193200305992181741359662904357290033429526059563073813232862794")
    seqs = [string.ascii_lowercase, string.ascii_uppercase, string.digits, "1234567890",
            "qwertyuiop", "asdfghjkl", "zxcvbnm", "QWERTYUIOP", "ASDFGHJKL", "ZXCVBNM",
            "qwertyuiopasdfghjklzxcvbnm", "QWERTYUIOPASDFGHJKLZXCVBNM", "azertyuiopqsdfghjklmwxcvbn",
            "qwertzuiopasdfghjklyxcvbnm",
            "!@#$%^&*()", "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik9ol0p", "qazwsxedcrfvtgbyhnujmikolp",
            "".join(str(i) for i in range(1, 1001)), pi, e]
    return "\x00".join(seqs + [x[::-1] for x in seqs]) + "\x00"


_KNOWN = _known()


def repeat_bits(text: str, per_char: float) -> float:
    """``text`` read left to right, each character costing ``per_char`` bits unless it
    starts a stretch of :data:`_MIN_MATCH` or more repeating one before it, or one of
    the sequences a guesser tries first (the alphabet, keyboard rows, counting, pi:
    :data:`_KNOWN`), which costs a back-reference instead (see the module docstring)."""
    n = len(text)
    if n > _LZ_LIMIT:   # what raw deflate makes of it (a 1 MiB secret in well under a second)
        z = zlib.compressobj(9, zlib.DEFLATED, -15, zdict=_KNOWN.encode())
        return 8.0 * len(z.compress(text.encode("utf-8", "surrogatepass")) + z.flush())
    base = len(_KNOWN)
    full = _KNOWN + text                 # references may reach into the known sequences
    bits, i = 0.0, 0
    where = math.log2(base + n) + 1      # where a reference points, and that it is one
    starts: dict[str, list[int]] = {}    # where each _MIN_MATCH characters began before
    done = 0                             # positions below this are in ``starts``

    def index(upto: int) -> None:
        nonlocal done
        for j in range(done, upto):
            starts.setdefault(full[j:j + _MIN_MATCH], []).append(j)
        done = max(done, upto)

    end = base + n
    while i < n:
        at = base + i
        index(at)
        best = 0
        for j in starts.get(full[at:at + _MIN_MATCH], ())[-_CHAIN:]:
            k = 0
            while at + k < end and full[j + k] == full[at + k]:
                k += 1
            best = max(best, k)
        ref = where + math.log2(max(best, 2))   # ... and how long
        # (taken only where it saves a byte: a chance match in a random secret is short)
        if best >= _MIN_MATCH and best * per_char > ref + _MARGIN:
            bits += ref
            i += best
        else:
            bits += per_char
            i += 1
    return bits


def secret_bits(secret: bytes) -> float:
    """A rough upper bound on the entropy of ``secret``: the smallest of its count as
    characters, as words and as repetition (see the module docstring); bytes that
    are not UTF-8 count 8 bits each, less what repeats."""
    try:
        text = secret.decode()
    except UnicodeDecodeError:
        return min(8.0 * len(secret), repeat_bits(secret.decode("latin-1"), 8.0))
    if not text:
        return 0.0
    chars = char_bits(text)
    # all hex digits: a random token (secrets.token_hex), whose letter runs read as words
    # by chance; the few words of a-f alone are left to the repetition count
    words = chars if _HEX.fullmatch(text) else word_bits(text)
    return min(chars, words, repeat_bits(text, chars / len(text)))
