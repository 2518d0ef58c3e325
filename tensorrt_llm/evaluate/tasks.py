"""The evaluation tasks, and the training data drawn from the same generators (different seeds).

Every generator takes a ``random.Random`` and returns one conversation: a list of
``{"role": "user" | "assistant", "content": str}`` messages, deterministic in the generator's state.

- ``gsm8k-tiny``: one arithmetic word problem, one operation (+ or -) on whole numbers up to 100,
  answered with the working shown column by column, ones first:
  ``58 + 67: 8 + 7 = 15, 5 + 6 + 1 = 12, so 125. The answer is 125.`` and
  ``53 - 27: 13 - 7 = 6, 4 - 2 = 2, so 26. The answer is 26.`` (a borrow shows as 13 and 4).
- ``multiturn-copy``: turn 1 gives a list of words and numbers to remember; turns 2-4 ask to repeat
  it, repeat it in capitals, and repeat its first three items. Each answer copies earlier text, so a
  drafter that can attend to the earlier turns (its KV intact after prefix reuse) predicts it well.
- ``long-prompt``: a secret code stated early in a long filler text, asked for at the end; the
  question sits far beyond ``top_k`` MSA blocks from the fact, so MSA must select the right block.
"""

from __future__ import annotations

import random
import re

Message = dict[str, str]

NAMES = [
    "Ann",
    "Ben",
    "Cara",
    "Dan",
    "Eve",
    "Finn",
    "Gus",
    "Hana",
    "Ivy",
    "Jon",
    "Kai",
    "Lea",
    "Max",
    "Nia",
    "Omar",
    "Pia",
]
ITEMS = [
    "apples",
    "books",
    "coins",
    "pens",
    "cards",
    "shells",
    "stamps",
    "marbles",
    "eggs",
    "cups",
    "rocks",
    "toys",
]
WORDS = [
    "red",
    "blue",
    "green",
    "lake",
    "tree",
    "stone",
    "river",
    "cloud",
    "moon",
    "star",
    "bird",
    "fish",
    "wolf",
    "bear",
    "rose",
    "leaf",
    "snow",
    "rain",
    "wind",
    "fire",
    "gold",
    "iron",
    "salt",
    "milk",
]
FILLER = [
    "The weather was calm and the streets were quiet.",
    "A small boat drifted slowly across the lake.",
    "Children played near the old stone bridge.",
    "The market opened early and closed at noon.",
    "Birds sang in the tall trees by the river.",
    "A light rain fell over the green hills.",
    "The library had many books about the stars.",
    "Farmers brought fresh milk and eggs to town.",
]

ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")


def column_working(a: int, b: int, op: str) -> str:
    """Column arithmetic, ones first: each column's digits, any carry or borrow, and the result."""
    digits = max(len(str(a)), len(str(b)))
    steps, carry = [], 0
    for col in range(digits):
        x, y = a // 10**col % 10, b // 10**col % 10
        if op == "+":
            total = x + y + carry
            steps.append(f"{x} + {y} + {carry} = {total}" if carry else f"{x} + {y} = {total}")
            carry = total // 10
        else:
            x -= carry
            carry = int(x < y)
            steps.append(f"{x + 10 * carry} - {y} = {x + 10 * carry - y}")
    result = a + b if op == "+" else a - b
    return f"{a} {op} {b}: {', '.join(steps)}, so {result}"


def gsm8k_tiny(rng: random.Random) -> tuple[list[Message], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(2, 100)
    if rng.random() < 0.5:
        b = rng.randint(1, 100)
        question = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        answer, working = a + b, column_working(a, b, "+")
    else:
        b = rng.randint(1, a)
        question = f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?"
        answer, working = a - b, column_working(a, b, "-")
    reply = f"{working}. The answer is {answer}."
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}], answer


def parse_answer(text: str) -> int | None:
    match = ANSWER_RE.search(text)
    return int(match.group(1)) if match else None


def _copy_list(rng: random.Random) -> list[str]:
    items = [rng.choice(WORDS) for _ in range(rng.randint(4, 7))]
    items.insert(rng.randrange(len(items)), str(rng.randint(100, 9999)))
    return items


def multiturn_copy(rng: random.Random) -> list[Message]:
    items = _copy_list(rng)
    text = " ".join(items)
    return [
        {"role": "user", "content": f"Remember this list: {text}"},
        {"role": "assistant", "content": f"I will remember: {text}"},
        {"role": "user", "content": "Repeat the list."},
        {"role": "assistant", "content": f"The list is: {text}"},
        {"role": "user", "content": "Repeat it in capitals."},
        {"role": "assistant", "content": f"In capitals: {text.upper()}"},
        {"role": "user", "content": "Repeat the first three items."},
        {"role": "assistant", "content": f"The first three: {' '.join(items[:3])}"},
    ]


def long_prompt(rng: random.Random, min_chars: int = 700) -> tuple[list[Message], str]:
    code = str(rng.randint(1000, 9999))
    sentences = [rng.choice(FILLER) for _ in range(2)]
    sentences.append(f"The secret code is {code}.")
    while sum(len(s) + 1 for s in sentences) < min_chars:
        sentences.append(rng.choice(FILLER))
    question = " ".join(sentences) + " What is the secret code?"
    reply = f"The secret code is {code}."
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}], code


# The evaluation problems: the first ``count`` items of each task's stream (its generator under a
# fixed seed). Training corpora skip the first MAX_EVAL_PROBLEMS of every stream, so no evaluation
# of up to that many problems per task sees a training conversation.
EVAL_SEED = 20_000
EVAL_STREAMS = {
    "gsm8k-tiny": (gsm8k_tiny, EVAL_SEED),
    "long-prompt": (long_prompt, EVAL_SEED + 1),
    "multiturn-copy": (multiturn_copy, EVAL_SEED + 2),
}
MAX_EVAL_PROBLEMS = 1000


def evaluation_problems(task: str, count: int) -> list:
    """The first ``count`` problems of ``task``'s evaluation stream (as its generator returns
    them: a conversation, or a conversation and its answer)."""
    if not 0 < count <= MAX_EVAL_PROBLEMS:
        raise ValueError(
            f"{task}: {count} problems asked; the corpora are held out from the first "
            f"{MAX_EVAL_PROBLEMS} only"
        )
    generator, seed = EVAL_STREAMS[task]
    rng = random.Random(seed)
    return [generator(rng) for _ in range(count)]


def first_user_turn(item) -> str:
    messages = item[0] if isinstance(item, tuple) else item
    return messages[0]["content"]


def evaluation_questions() -> set[str]:
    """The first user turn of every problem the corpora are held out from."""
    return {
        first_user_turn(item)
        for task in EVAL_STREAMS
        for item in evaluation_problems(task, MAX_EVAL_PROBLEMS)
    }


def held_out_record() -> dict:
    """What a corpus built with ``exclude=evaluation_questions()`` excludes (``training.json``)."""
    return {
        "tasks": {task: {"seed": seed} for task, (_, seed) in EVAL_STREAMS.items()},
        "first_problems_per_task": MAX_EVAL_PROBLEMS,
    }


# gsm8k-tiny, multiturn-copy, long-prompt
TRAINING_MIX = (0.5, 0.3, 0.2)


def training_conversations(
    seed: int,
    count: int,
    long_min_chars: int = 700,
    exclude: frozenset[str] | set[str] = frozenset(),
    mix: tuple[float, float, float] = TRAINING_MIX,
) -> tuple[list[list[Message]], int]:
    """The training mix, by default 50% gsm8k-tiny, 30% multiturn-copy, 20% long-prompt (``mix``:
    the shares of the three, summing to 1; seeded), without any conversation whose first user
    turn is in ``exclude``. Returns the ``count`` conversations kept and how many were drawn and
    skipped."""
    if len(mix) != 3 or min(mix) < 0 or abs(sum(mix) - 1) > 1e-6:
        raise ValueError(f"mix={mix}: expected three non-negative shares summing to 1")
    rng = random.Random(seed)
    out: list[list[Message]] = []
    skipped = 0
    while len(out) < count:
        r = rng.random()
        if r < mix[0]:
            conv = gsm8k_tiny(rng)[0]
        elif r < mix[0] + mix[1]:
            conv = multiturn_copy(rng)
        else:
            conv = long_prompt(rng, long_min_chars)[0]
        if conv[0]["content"] in exclude:
            skipped += 1
        else:
            out.append(conv)
    return out, skipped
