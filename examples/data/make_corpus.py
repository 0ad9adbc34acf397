"""Rebuild the generated part of corpus.txt: deterministic fables from a small grammar.

    python examples/data/make_corpus.py

corpus.txt holds passages written out by hand (public-domain works), then a marker line, then
the generated fables below it. This script keeps everything above the marker and rewrites what
follows, so the file is reproducible. Standard library only; the output depends on nothing but
SEED and FABLES.
"""

from __future__ import annotations

import os
import random
import textwrap

MARKER = "GENERATED FABLES (examples/data/make_corpus.py)"
SEED = 1863
FABLES = 150

ANIMALS = ["Fox", "Crow", "Wolf", "Lamb", "Hare", "Tortoise", "Lion", "Mouse", "Goat", "Ox", "Frog",
           "Stork", "Heron", "Bear", "Badger", "Owl", "Sparrow", "Ant", "Bee", "Horse", "Donkey",
           "Cat", "Dog", "Rooster", "Swan", "Eagle", "Beetle", "Deer", "Otter", "Magpie"]
PLACES = ["by the river", "at the edge of the wood", "on the hill above the village", "in the old mill",
          "beside the well", "in a field of barley", "under the great oak", "near the king's road",
          "on the bank of a pond", "in the orchard", "among the reeds", "at the foot of the mountain"]
SEASONS = ["one cold morning in winter", "on a hot day in summer", "early in the spring",
           "when the leaves were falling", "one evening after rain", "at the time of the harvest"]
UNTIL = ["the snow came", "the sun went down", "the harvest was in", "the moon rose", "the rain stopped"]
WANTS = ["a piece of cheese", "a drink of clear water", "a warm place to sleep", "the ripest pear",
         "a crust of bread", "the shining bell", "a safe road home", "the golden grain",
         "a seat by the fire", "the last of the honey"]
TRAITS = ["proud", "clever", "greedy", "patient", "idle", "honest", "boastful", "kind", "timid",
          "foolish", "wise", "quick"]
DEEDS = ["laughed at", "tried to trick", "offered to help", "ran a race with", "made a bargain with",
         "asked advice of", "quarrelled with", "shared a meal with", "hid from", "followed"]
MORALS = ["Slow and steady wins the race.", "Pride goes before a fall.",
          "A friend in need is a friend indeed.", "Look before you leap.",
          "Do not count your chickens before they are hatched.", "Honesty is the best policy.",
          "Little by little does the trick.", "Gratitude is the sign of noble souls.",
          "Those who flatter are not to be trusted.", "Better to be content with little.",
          "United we stand, divided we fall.", "Self-help is the best help.",
          "It is easy to be brave from a safe distance.", "Every thing has its season."]
SAYINGS = ["Why are you in such a hurry?", "What will you give me for it?", "Who goes there?",
           "Wait for me, friend!", "Is this the way to the river?", "I shall have it yet.",
           "There is enough for both of us.", "You will be sorry for this.",
           "Can you keep a secret?", "Teach me how you did it."]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiouAEIOU" else "a ") + word


def _quote(saying: str) -> str:
    return saying[:-1] + "," if saying.endswith(".") else saying


def fable(rng: random.Random) -> str:
    """One fable: a title, a paragraph of story and a moral."""
    a, b = rng.sample(ANIMALS, 2)
    ta, tb = rng.choice(TRAITS), rng.choice(TRAITS)
    want = rng.choice(WANTS)
    lines = [
        f"THE {a.upper()} AND THE {b.upper()}",
        "",
        f"{rng.choice(SEASONS).capitalize()} {_a(ta)} {a} lived {rng.choice(PLACES)}, and wanted nothing so much "
        f"as {want}. {_a(tb).capitalize()} {b} came along the path, and the {a} {rng.choice(DEEDS)} the {b}.",
        f"\"{_quote(rng.choice(SAYINGS))}\" said the {b}. \"{_quote(rng.choice(SAYINGS))}\" answered the {a}.",
    ]
    if rng.random() < 0.5:
        lines.append(f"So the two went together {rng.choice(PLACES)}, and there the {b} found {want}, "
                     f"but the {a} found only {rng.choice(WANTS)}.")
    else:
        lines.append(f"The {a} waited {rng.choice(PLACES)} until {rng.choice(UNTIL)}, and by then "
                     f"the {b} had gone away with {want}.")
    lines += [f"And the {b} said to the {a}: \"{rng.choice(MORALS)}\"", ""]
    title, *story = lines
    return title + "\n\n" + textwrap.fill(" ".join(x for x in story if x), 96) + "\n\n"


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head = text.split(MARKER)[0].rstrip("\n") + "\n\n"
    rng = random.Random(SEED)
    body = "".join(fable(rng) for _ in range(FABLES))
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + MARKER + "\n\n" + body)
    print(f"wrote {path}: {len((head + body).encode())} bytes")


if __name__ == "__main__":
    main()
