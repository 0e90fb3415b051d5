"""Write the ``chat`` sample dataset: a toy assistant with a fixed, learnable answer style.

Three kinds of question (capital cities, adding small numbers, mixing paint colours), answered in
one sentence that repeats the question's words, so a tiny random model learns the format (and,
for sums and colours, the rule) in a hundred updates. Some conversations carry a system message
and some have two exchanges, so the assistant-only loss mask has something to do.

Deterministic (a seeded ``random.Random``): running it again writes the same bytes. Usage, from the
repository root::

    python sample_datasets/chat/make_chat.py [output folder, default sample_datasets/chat]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20240607
N_TRAIN = 64
N_VALID = 12

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
    "Egypt": "Cairo", "Peru": "Lima", "Chile": "Santiago", "Kenya": "Nairobi", "Greece": "Athens",
    "Norway": "Oslo", "Poland": "Warsaw", "Cuba": "Havana", "Canada": "Ottawa", "Ireland": "Dublin",
    "Portugal": "Lisbon", "Austria": "Vienna", "Sweden": "Stockholm",
}
MIXES = {
    ("red", "blue"): "purple", ("blue", "yellow"): "green", ("red", "yellow"): "orange",
    ("red", "white"): "pink", ("black", "white"): "grey", ("blue", "white"): "light blue",
}
SYSTEM = "You are a helpful assistant. Answer the question briefly and clearly."


def capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def mix(rng: random.Random) -> tuple[str, str]:
    (c1, c2), result = rng.choice(sorted(MIXES.items()))
    if rng.random() < 0.5:
        c1, c2 = c2, c1
    return f"What do you get when you mix {c1} and {c2}?", f"Mixing {c1} and {c2} gives {result}."


TASKS = (capital, addition, mix)


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": SYSTEM})
    for _ in range(2 if rng.random() < 0.25 else 1):
        question, answer = rng.choice(TASKS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main(out: Path) -> None:
    rng = random.Random(SEED)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < N_TRAIN + N_VALID:
        conv = conversation(rng)
        key = json.dumps(conv, sort_keys=True)
        if key not in seen:  # no conversation both trained on and held out
            seen.add(key)
            rows.append(conv)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", rows[:N_TRAIN]), ("valid.jsonl", rows[N_TRAIN:])):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
        print(f"{out / name}: {len(part)} conversations")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
