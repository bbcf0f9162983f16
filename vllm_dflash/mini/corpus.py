"""The miniature's synthetic corpus and its held-apart prompt set (stdlib only, deterministic, seeded).

A document is a run of numbered lines, each of one of six templated kinds (counting, copying a random string,
spelling a word, a person record, an alphabet run, a templated sentence). Every line mixes unpredictable slots (a
random string, a start number, a name) with spans that are fully determined by what came before (the copy, the rest
of the count, the spelled letters, the template words), so a drafter can guess several tokens ahead only part of the
time: acceptance lengths land in the middle of the block rather than at its cap. Copies and spellings reach back
about 5-20 tokens, around the drafter's sliding window, so the window shapes what it can see.

The text is plain ASCII (one byte = one token with the byte-level tokenizer) and contains no EOS token: the target
never learns to stop, so generation runs to max_tokens with or without EOS handling.

Training text and prompts come from disjoint seeded streams; `held_apart_prompts` asserts that no prompt occurs
anywhere in the training text it is given.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_WORDS = (
    "apple bread candle dragon engine forest garden harbor island jacket kettle lantern marble needle orange "
    "pillow quartz river saddle tunnel umbrella velvet window yellow zipper anchor bottle castle dinner feather "
    "guitar hammer insect jungle kitten ladder mirror napkin oyster pepper rabbit silver timber valley walnut"
).split()
_NAMES = "alice bruno clara david elena felix grace henry irene jonas karen lucas maria nolan olivia peter".split()
_CITIES = "paris oslo lima cairo tokyo quito rome delhi berlin dublin madrid vienna".split()
_ADJS = "red quick lazy small bright quiet old brave".split()
_ANIMALS = "fox dog cat owl bear wolf hare crow".split()
_VERBS = "jumps over|runs past|sits near|looks at|waits for|hides from".split("|")
_NOUNS = "fence river table stone bridge wall".split()
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _line(rng: random.Random, kind: int) -> str:
    if kind == 0:
        step = rng.choice((1, 1, 2, 5, 10))
        start = rng.randrange(0, 90) * (step if step > 2 else 1)
        n = rng.randint(4, 7)
        by = f" by {step}" if step != 1 else ""
        return f"count{by} from {start}: " + " ".join(str(start + i * step) for i in range(n))
    if kind == 1:
        s = "".join(rng.choice(_ALNUM) for _ in range(rng.randint(3, 8)))
        return f"copy {s} -> {s}"
    if kind == 2:
        w = rng.choice(_WORDS)
        return f"spell {w}: " + "-".join(w)
    if kind == 3:
        return (
            f"{rng.choice(_NAMES)} is {rng.randint(18, 79)}, lives in {rng.choice(_CITIES)}, "
            f"likes {rng.choice(_WORDS)}s"
        )
    if kind == 4:
        i = rng.randrange(0, 20)
        n = rng.randint(4, 6)
        return f"letters from {_LETTERS[i]}: " + " ".join(_LETTERS[i : i + n])
    adj, animal, verb = rng.choice(_ADJS), rng.choice(_ANIMALS), rng.choice(_VERBS)
    return f"the {adj} {animal} {verb} the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"


KINDS = 6


def document(rng: random.Random, min_chars: int) -> str:
    """Numbered lines ("17. <line>") until the text has at least `min_chars` characters. The kinds follow a fixed
    cycle from a random start, so a model's greedy continuation keeps changing kind instead of looping on one."""
    number = rng.randint(1, 80)
    kind = rng.randrange(KINDS)
    lines: list[str] = []
    size = 0
    while size < min_chars:
        line = f"{number}. {_line(rng, kind)}\n"
        lines.append(line)
        size += len(line)
        number += 1
        kind = (kind + 1) % KINDS
    return "".join(lines)


# Seeds of the two streams: training documents and held-apart documents never share a generator.
TRAIN_STREAM = 1
HELD_APART_STREAM = 2


def documents(seed: int, stream: int, min_chars: int) -> Iterator[str]:
    """An endless deterministic stream of documents (`stream` separates training from held-apart text)."""
    rng = random.Random(f"vllm-dflash-mini/{seed}/{stream}")
    while True:
        yield document(rng, min_chars)


def training_documents(seed: int, count: int, min_chars: int) -> list[str]:
    it = documents(seed, TRAIN_STREAM, min_chars)
    return [next(it) for _ in range(count)]


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str


def held_apart_prompts(
    seed: int, count: int, min_len: int, max_len: int, training_text: Iterable[str] | None = None
) -> list[Prompt]:
    """`count` prompts from the held-apart stream: a document cut at a random point, `min_len`..`max_len` chars.

    With `training_text` (every text the models were trained on), asserts that no prompt occurs in any of them.
    """
    rng = random.Random(f"vllm-dflash-mini/{seed}/prompt-cuts")
    docs = documents(seed, HELD_APART_STREAM, max_len)
    prompts: list[Prompt] = []
    for i in range(count):
        doc = next(docs)
        prompts.append(Prompt(id=f"mini-{i:03d}", prompt=doc[: rng.randint(min_len, max_len)]))
    if training_text is not None:
        assert_disjoint(prompts, training_text)
    return prompts


def assert_disjoint(prompts: Iterable[Prompt], training_text: Iterable[str]) -> None:
    # NUL never occurs in the corpus, so joining on it cannot create a match across two texts.
    haystack = "\0".join(training_text)
    for p in prompts:
        if p.prompt in haystack:
            raise AssertionError(f"held-apart prompt {p.id} occurs in the training text")
