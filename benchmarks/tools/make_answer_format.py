"""Write the kit's instruction data set `kit/data/answer-format.jsonl` and its held-out prompts
`kit/data/answer-format-heldout.jsonl` (notebook 12): short questions whose reply is always one
line, `ANSWER: <answer>`. A pretrained chat model answers them in sentences; a few dozen LoRA
steps teach it the form, which a person sees and a regular expression counts.

    python3 benchmarks/tools/make_answer_format.py            # rewrites both files (deterministic)
    python3 benchmarks/tools/make_answer_format.py --out DIR  # elsewhere (the test compares the bytes)

Every question is written here from small tables (capitals, opposites, colours, counts, sums and
products); the held-out prompts use items that no training row mentions.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "Greece": "Athens",
    "Ireland": "Dublin",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Hungary": "Budapest",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Argentina": "Buenos Aires",
    "Mexico": "Mexico City",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Cuba": "Havana",
    "Belgium": "Brussels",
    "the Netherlands": "Amsterdam",
    "Turkey": "Ankara",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "South Korea": "Seoul",
    "India": "New Delhi",
    "Australia": "Canberra",
    "Brazil": "Brasilia",
    "Colombia": "Bogota",
    "Morocco": "Rabat",
    "Nigeria": "Abuja",
    "Ukraine": "Kyiv",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "open": "closed",
    "full": "empty",
    "early": "late",
    "rich": "poor",
    "young": "old",
    "strong": "weak",
    "wet": "dry",
    "hard": "soft",
    "loud": "quiet",
    "thick": "thin",
    "high": "low",
    "near": "far",
    "clean": "dirty",
    "heavy": "light",
    "long": "short",
    "inside": "outside",
    "push": "pull",
    "win": "lose",
    "true": "false",
    "day": "night",
    "begin": "end",
    "buy": "sell",
    "left": "right",
    "north": "south",
}
COLOURS = {
    "the sky on a clear day": "blue",
    "fresh grass": "green",
    "snow": "white",
    "a ripe banana": "yellow",
    "coal": "black",
    "a ripe tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "milk": "white",
    "a crow": "black",
    "a strawberry": "red",
    "a lime": "green",
    "chocolate": "brown",
    "the sea": "blue",
    "a carrot": "orange",
    "a polar bear": "white",
}
COUNTS = {
    "legs does a spider have": "8",
    "legs does a dog have": "4",
    "legs does a bird have": "2",
    "legs does an insect have": "6",
    "days are in a week": "7",
    "months are in a year": "12",
    "hours are in a day": "24",
    "minutes are in an hour": "60",
    "sides does a triangle have": "3",
    "sides does a square have": "4",
    "wheels does a bicycle have": "2",
    "days are in a leap year": "366",
    "sides does a hexagon have": "6",
    "seconds are in a minute": "60",
    "legs does a cow have": "4",
    "wheels does a tricycle have": "3",
    "players are on a soccer team": "11",
    "cents are in a dollar": "100",
}
# Items the held-out prompts ask about; no training row mentions them.
HELD_OUT = {
    "capital": ["France", "Japan", "Egypt", "Canada", "Norway", "Peru", "Kenya", "Greece"],
    "opposite": ["hot", "fast", "full", "young", "wet", "loud", "clean", "early"],
    "colour": ["snow", "coal", "a ripe tomato", "a lime"],
    "count": [
        "legs does a spider have",
        "days are in a week",
        "sides does a triangle have",
        "months are in a year",
    ],
    "sum": [(7, 5), (12, 9), (23, 14), (40, 8)],
    "product": [(3, 4), (6, 7), (9, 2), (5, 5)],
}
ASK = {
    "capital": [
        "What is the capital of {}?",
        "Which city is the capital of {}?",
        "Name the capital of {}.",
        "What city is {}'s capital?",
    ],
    "opposite": [
        "What is the opposite of {}?",
        "Give the opposite of the word '{}'.",
        "What word means the opposite of {}?",
    ],
    "colour": ["What color is {}?", "Which color is {}?"],
    "count": ["How many {}?"],
    "sum": ["What is {} plus {}?", "Add {} and {}.", "What is the sum of {} and {}?"],
    "product": ["What is {} times {}?", "Multiply {} by {}.", "What is {} multiplied by {}?"],
}


ANSWER_OF = {
    "capital": CAPITALS.get,
    "opposite": OPPOSITES.get,
    "colour": COLOURS.get,
    "count": COUNTS.get,
    "sum": lambda a, b: str(a + b),
    "product": lambda a, b: str(a * b),
}


def _row(question: str, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"ANSWER: {answer}"},
        ]
    }


def build(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows). Training: every table item but the held-out ones (capitals
    and opposites in two phrasings), and random sums and products; each phrasing drawn at random."""
    rng = random.Random(seed)
    asked = {
        "capital": [(k,) for k in CAPITALS],
        "opposite": [(k,) for k in OPPOSITES],
        "colour": [(k,) for k in COLOURS],
        "count": [(k,) for k in COUNTS],
        "sum": sorted({(rng.randint(2, 49), rng.randint(2, 49)) for _ in range(70)}),
        "product": sorted({(rng.randint(2, 12), rng.randint(2, 12)) for _ in range(60)}),
    }
    train, held = [], []
    for kind, all_args in asked.items():
        held_args = [a if isinstance(a, tuple) else (a,) for a in HELD_OUT[kind]]
        times = 2 if kind in ("capital", "opposite") else 1
        for args in all_args:
            if args not in held_args:
                train += [
                    _row(q.format(*args), ANSWER_OF[kind](*args))
                    for q in rng.sample(ASK[kind], min(times, len(ASK[kind])))
                ]
        held += [
            _row(rng.choice(ASK[kind]).format(*args), ANSWER_OF[kind](*args)) for args in held_args
        ]
    rng.shuffle(train)
    return train, held


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[2] / "kit" / "data")
    out = parser.parse_args(argv).out
    train, held = build()
    for name, rows in (("answer-format.jsonl", train), ("answer-format-heldout.jsonl", held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
