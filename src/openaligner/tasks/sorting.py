"""The built-in "sort the digits" task: prompts, demonstrations, preference pairs and a gold scorer.

Owns the prompts (``sort 5 2 8 1 :``), the gold scorer (0–100, the share of positions that match
the sorted digits), the deliberately mixed SFT demonstrations and the noisy preference pairs.
Everything is deterministic from a seed. Must not know models or training.
Design notes: docs/demo.md, "Module notes".
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DIGITS = tuple(str(d) for d in range(10))
PROMPT_WORD = "sort"
SEPARATOR = ":"
VOCABULARY: tuple[str, ...] = (PROMPT_WORD, SEPARATOR, *DIGITS)
"""Every word of the task; a word-level tokenizer over these has 4 specials + 12 words."""


@dataclass(frozen=True)
class SortingTaskConfig:
    min_digits: int = 4  # shortest list in a prompt
    max_digits: int = 6  # longest list in a prompt
    sorted_fraction: float = 0.3  # share of SFT demonstrations that are correctly sorted
    label_noise: float = 0.1  # probability that a preference label is flipped


def make_prompt(digits: Sequence[int]) -> str:
    return " ".join([PROMPT_WORD, *map(str, digits), SEPARATOR])


def parse_prompt(prompt: str) -> list[int]:
    words = prompt.split()
    if len(words) < 2 or words[0] != PROMPT_WORD or words[-1] != SEPARATOR:
        raise ValueError(f"not a sorting prompt: {prompt!r}")
    return [int(w) for w in words[1:-1]]


def answer(prompt: str) -> str:
    return " ".join(map(str, sorted(parse_prompt(prompt))))


def gold_score(prompt: str, response: str) -> float:
    """Percentage (0–100) of positions where ``response`` matches the sorted digits."""
    target = answer(prompt).split()
    words = response.split()
    hits = sum(1 for a, b in zip(words, target, strict=False) if a == b)
    return 100.0 * hits / max(len(words), len(target))


def is_exact(prompt: str, response: str) -> bool:
    """Whether ``response`` is exactly the sorted digits (words compared; spacing aside)."""
    return response.split() == answer(prompt).split()


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The gold scorer as a reward function for ``serve-reward reward.function=
    openaligner.tasks.sorting:gold_reward``: the share (0–1) of positions where each response
    matches its prompt's sorted digits (:func:`gold_score` / 100)."""
    return [gold_score(p, r) / 100.0 for p, r in zip(prompts, responses, strict=True)]


def random_digits(rng: random.Random, cfg: SortingTaskConfig) -> list[int]:
    return [rng.randrange(10) for _ in range(rng.randint(cfg.min_digits, cfg.max_digits))]


def _shuffled_unsorted(digits: list[int], rng: random.Random) -> list[int]:
    out = digits[:]
    for _ in range(10):
        rng.shuffle(out)
        if out != sorted(out) or len(set(out)) == 1:
            break
    return out


def demonstration(prompt: str, rng: random.Random, cfg: SortingTaskConfig) -> str:
    """An SFT response: sorted with probability ``sorted_fraction``, else a shuffle of the digits."""
    digits = parse_prompt(prompt)
    out = sorted(digits) if rng.random() < cfg.sorted_fraction else _shuffled_unsorted(digits, rng)
    return " ".join(map(str, out))


def candidate(prompt: str, rng: random.Random, cfg: SortingTaskConfig) -> str:
    """A response to be judged: a demonstration, or a corrupted sort.

    Half are demonstrations (what the SFT policy produces); the rest are sorts with a wrong,
    missing or extra digit, or ascending digits unrelated to the prompt. Without these the
    reward model never sees "sorted but wrong" and PPO learns to exploit that blind spot.
    """
    if rng.random() < 0.5:
        return demonstration(prompt, rng, cfg)
    digits = sorted(parse_prompt(prompt))
    kind = rng.randrange(4)
    if kind == 0:  # one digit replaced
        digits[rng.randrange(len(digits))] = rng.randrange(10)
    elif kind == 1 and len(digits) > 1:  # one digit dropped
        digits.pop(rng.randrange(len(digits)))
    elif kind == 2:  # one digit repeated
        digits.insert(rng.randrange(len(digits) + 1), rng.choice(digits))
    else:  # ascending digits unrelated to the prompt
        digits = sorted(rng.randrange(10) for _ in range(len(digits)))
    if kind < 3 and rng.random() < 0.5:
        digits = sorted(digits)
    return " ".join(map(str, digits))


@dataclass(frozen=True)
class TaskData:
    sft: list[dict[str, str]]  # {"prompt", "response"}
    preferences: list[dict[str, str]]  # {"prompt", "chosen", "rejected"}
    ppo_prompts: list[dict[str, str]]  # {"prompt"}
    val_prompts: list[dict[str, str]]  # {"prompt"}


def generate_task_data(
    seed: int, n_sft: int, n_pref: int, n_ppo: int, n_val: int, cfg: SortingTaskConfig = SortingTaskConfig()
) -> TaskData:
    """All four data sets of the task, disjoint in their random streams, reproducible from ``seed``."""
    rng = random.Random(seed)

    def prompts(n: int) -> list[str]:
        return [make_prompt(random_digits(rng, cfg)) for _ in range(n)]

    sft = [{"prompt": p, "response": demonstration(p, rng, cfg)} for p in prompts(n_sft)]
    preferences = []
    for p in prompts(n_pref):
        a, b = candidate(p, rng, cfg), candidate(p, rng, cfg)
        for _ in range(10):
            if gold_score(p, a) != gold_score(p, b):
                break
            b = candidate(p, rng, cfg)
        a_better = gold_score(p, a) >= gold_score(p, b)
        if rng.random() < cfg.label_noise:
            a_better = not a_better
        chosen, rejected = (a, b) if a_better else (b, a)
        preferences.append({"prompt": p, "chosen": chosen, "rejected": rejected})
    ppo = [{"prompt": p} for p in prompts(n_ppo)]
    val = [{"prompt": p} for p in prompts(n_val)]
    return TaskData(sft, preferences, ppo, val)


def write_jsonl(rows: Sequence[dict[str, str]], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def mean_gold_score(prompts: Sequence[str], responses: Sequence[str]) -> float:
    return sum(gold_score(p, r) for p, r in zip(prompts, responses, strict=True)) / max(len(prompts), 1)
