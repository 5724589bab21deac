"""A generated text-classification set: short product and service reviews in four classes, built with ``datasets``.

Nothing is downloaded and nothing is stored in git: sentences come from the templates and word lists below,
drawn with a fixed seed, so every process (and every run) builds the same rows. The classes are chosen so
that a sentence embedding alone does not separate them: every class uses the same subjects and the same
frames, negation flips praise into a complaint ("was not great" is negative), and questions reuse the
evaluative words of the other classes.

* ``negative``: "the soup was awful", "the laptop was not reliable at all"
* ``neutral``: factual statements ("the laptop arrived on Tuesday")
* ``positive``: "the soup was delicious", "I could not be happier with the laptop"
* ``question``: "was the soup delicious?", "is the laptop reliable or not?"

Example::

    splits = review_dataset(n=2000, seed=0)     # DatasetDict with "train" and "validation"
    splits["train"][0]                          # {"text": "...", "label": 2}
"""

from __future__ import annotations

import random

LABELS = ("negative", "neutral", "positive", "question")

_THINGS = [
    "the soup", "the pasta", "the coffee", "the hotel room", "the laptop", "the new phone", "the movie",
    "the concert", "the delivery", "the customer service", "the train ride", "the museum tour", "the app",
    "the headphones", "the bakery", "the football match", "the keyboard", "the guided hike",
]  # fmt: skip
_GOOD = [
    "great", "delicious", "wonderful", "excellent", "reliable", "fantastic", "friendly", "comfortable",
    "impressive", "lovely", "fast", "brilliant",
]  # fmt: skip
_BAD = [
    "awful", "terrible", "disappointing", "slow", "boring", "broken", "rude", "overpriced", "noisy",
    "cold", "useless", "dreadful",
]  # fmt: skip
_WAS = ["was", "is", "seemed", "turned out to be", "felt"]
_ADV = ["", "really ", "quite ", "truly ", "rather ", "honestly "]
_FACTS = [
    "{t} arrived on {day}", "{t} {was} booked for {day}", "I tried {t} on {day}", "{t} costs twelve euros",
    "we talked about {t} {when}", "my sister ordered {t} {when}", "{t} was reviewed by three people",
    "{t} opens at nine", "I will see {t} again {when}",
]  # fmt: skip
_DAYS = ["Monday", "Tuesday", "Friday", "the weekend", "my birthday"]
_WHEN = ["yesterday", "last week", "this morning", "after lunch", "tonight"]
_PREFIX = ["", "", "Honestly, ", "In my opinion, ", "To be fair, ", "Well, ", "So, "]


def _pick(rng: random.Random, items: list[str]) -> str:
    return rng.choice(items)


def _capitalize(s: str) -> str:
    return s[0].upper() + s[1:]


def sentence(rng: random.Random, label: int) -> str:
    t, was, adv = _pick(rng, _THINGS), _pick(rng, _WAS), _pick(rng, _ADV)
    kind = LABELS[label]
    if kind == "positive":
        s = _pick(
            rng,
            [
                f"{t} {was} {adv}{_pick(rng, _GOOD)}",
                f"{t} {was} not {_pick(rng, _BAD)} at all, it {was} {_pick(rng, _GOOD)}",
                f"I could not be happier with {t}",
                f"I would recommend {t} to anyone, it {was} {_pick(rng, _GOOD)}",
            ],
        )
    elif kind == "negative":
        s = _pick(
            rng,
            [
                f"{t} {was} {adv}{_pick(rng, _BAD)}",
                f"{t} {was} not {_pick(rng, _GOOD)} at all",
                f"{t} {was} not {adv}{_pick(rng, _GOOD)}, it {was} {_pick(rng, _BAD)}",
                f"I would not recommend {t} to anyone",
            ],
        )
    elif kind == "neutral":
        s = _pick(rng, _FACTS).format(t=t, was=was, day=_pick(rng, _DAYS), when=_pick(rng, _WHEN))
    else:
        q = _pick(
            rng,
            [
                f"was {t} {_pick(rng, _GOOD + _BAD)}",
                f"is {t} {_pick(rng, _GOOD + _BAD)} or not",
                f"would you recommend {t}",
                f"did anyone try {t} {_pick(rng, _WHEN)}",
            ],
        )
        return _capitalize(f"{_pick(rng, _PREFIX)}{q}?")
    return _capitalize(f"{_pick(rng, _PREFIX)}{s}.")


def review_dataset(n: int = 2000, val_fraction: float = 0.2, seed: int = 0):
    """``n`` labelled sentences (balanced over :data:`LABELS`) split into train/validation, deterministically."""
    from datasets import Dataset

    rng = random.Random(seed)
    labels = [i % len(LABELS) for i in range(n)]
    texts = [sentence(rng, y) for y in labels]
    splits = Dataset.from_dict({"text": texts, "label": labels}).train_test_split(test_size=val_fraction, seed=seed)
    splits["validation"] = splits.pop("test")
    return splits
