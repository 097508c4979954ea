"""Built-in tasks with programmatic scorers, used by ``openaligner demo`` and the tests."""

from collections.abc import Callable

from openaligner.tasks import reverse_text, sorting

ResponseScorer = Callable[[list[str], list[str]], list[float]]

TASK_SCORERS: dict[str, Callable[[str, str], float]] = {
    "sorting": sorting.gold_score,
    "reverse_text": reverse_text.gold_score,
}
"""Name → ``(prompt text, response text) → score`` of each built-in task (sorting: 0–100,
reverse_text: 0–1)."""


def task_scorer(name: str) -> ResponseScorer:
    """The batch scorer of a built-in task: ``(prompts, responses) → scores``."""
    score = TASK_SCORERS[name]

    def scorer(prompts: list[str], responses: list[str]) -> list[float]:
        return [score(p, r) for p, r in zip(prompts, responses, strict=True)]

    return scorer


TASK_EXACT: dict[str, Callable[[str, str], bool]] = {
    "sorting": sorting.is_exact,
    "reverse_text": reverse_text.is_exact,
}
"""Name → ``(prompt text, response text) → whether the response does the task exactly`` (sorting:
the digits in order, nothing else; reverse_text: the first line is the reversal). A score can
rise without it (a partial answer scores > 0); this is the number that says the task is done."""

TASK_TARGETS: dict[str, Callable[[str], str]] = {
    "sorting": sorting.answer,
    "reverse_text": reverse_text.answer,
}
"""Name → ``prompt text → the right answer``, for example outputs beside the scores."""
