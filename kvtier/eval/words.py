"""Word material for needles and word lists, drawn from a seeded `random.Random`.

RULER takes needle keys ("adjective-noun") and the common-words pool from the `wonderwords`
package; kvtier ships no third-party word lists, so the keys come from the short lists below and
the word pool from the prose haystack that ships with kvtier (`data/*.txt`), topped up with
random lowercase "coded words" (RULER's fwe vocabulary) when a long list needs more.
"""

from __future__ import annotations

import random
import re
import string

ADJECTIVES = (
    "amber", "ancient", "autumn", "bitter", "bold", "brave", "bright", "broken", "calm", "clever",
    "cold", "crimson", "curious", "distant", "dusty", "eager", "early", "empty", "faint", "fancy",
    "fierce", "gentle", "golden", "grand", "hidden", "hollow", "humble", "icy", "jolly", "lazy",
    "little", "lively", "lonely", "loud", "lucky", "misty", "modest", "narrow", "nimble", "noble",
    "odd", "pale", "patient", "proud", "quick", "quiet", "rapid", "restless", "rough", "rusty",
    "silent", "silver", "sleepy", "slow", "smooth", "solid", "steep", "stormy", "sunny", "swift",
    "tall", "tender", "tidy", "tiny", "velvet", "vivid", "warm", "wild", "windy", "wooden",
)  # fmt: skip

NOUNS = (
    "anchor", "apple", "arrow", "badger", "basket", "beacon", "bell", "bridge", "button", "candle",
    "canyon", "castle", "cedar", "cloud", "comet", "compass", "copper", "cottage", "crane", "desert",
    "dragon", "falcon", "feather", "forest", "fountain", "garden", "glacier", "harbor", "hammer",
    "island", "jacket", "kettle", "ladder", "lantern", "meadow", "mirror", "mountain", "needle",
    "orchard", "otter", "palace", "pebble", "pepper", "pigeon", "planet", "pocket", "puzzle",
    "quarry", "rabbit", "ribbon", "river", "saddle", "signal", "spoon", "statue", "teapot", "thunder",
    "tiger", "tower", "trumpet", "tunnel", "valley", "violin", "wagon", "walrus", "willow", "window",
)  # fmt: skip

_WORD_RE = re.compile(r"[a-z]+")


def word_key(rng: random.Random) -> str:
    """A needle key like "quiet-harbor" (RULER's `words` keys)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def distinct_keys(rng: random.Random, n: int) -> list[str]:
    """`n` different word keys."""
    keys: list[str] = []
    while len(keys) < n:
        key = word_key(rng)
        if key not in keys:
            keys.append(key)
    return keys


def number_value(rng: random.Random) -> str:
    """A random 7-digit integer as text (RULER's `numbers` values)."""
    return str(rng.randint(1_000_000, 9_999_999))


def variable_names(rng: random.Random, n: int) -> list[str]:
    """`n` different names of 5 random uppercase letters (RULER variable tracking)."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def word_pool(text: str, min_len: int = 4) -> list[str]:
    """Sorted distinct lowercase words of at least `min_len` letters in `text`."""
    return sorted({w for w in _WORD_RE.findall(text.lower()) if len(w) >= min_len})


def sample_words(pool: list[str], rng: random.Random, n: int) -> list[str]:
    """`n` distinct words: from `pool` while it lasts, then 6-letter coded words."""
    if n <= len(pool):
        return rng.sample(pool, n)
    words = rng.sample(pool, len(pool))
    seen = set(words)
    while len(words) < n:
        coded = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        if coded not in seen:
            seen.add(coded)
            words.append(coded)
    return words
