"""A math-answer verifier as a reward function: ``serve-reward reward.function=
openaligner.tasks.math_answer:verify`` with ``data.metadata_keys=[answer]`` in train-ppo.

Scores 1.0 when the response's final answer equals the reference answer mathematically (``1/2``,
``0.5`` and ``\\frac{1}{2}`` agree), else 0.0, using the ``math-verify`` package (Hugging Face's
verifier; the ``math`` extra: ``pip install 'openaligner[math]'``). It is imported when the first
call comes, so that the server's worker reports a missing package on that call, naming the extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ANSWER_KEY = "answer"
"""The metadata key holding each prompt's reference answer (a prompt-record field sent by
train-ppo's ``data.metadata_keys``)."""
LABEL_KEY = "label"
"""Where other frameworks' requests put the reference answer (their samples' ``label``; see
:mod:`openaligner.servers.reward_formats`); read when there is no ``answer``."""


def verify(prompts: list[str], responses: list[str], metadata: list[Mapping[str, Any]]) -> list[float]:
    """1.0 for each response whose answer matches ``metadata[i]["answer"]`` (else its ``label``),
    else 0.0.

    Raises:
        KeyError: a row's metadata has neither ``answer`` nor ``label`` (the message names
            ``data.metadata_keys``).
        ImportError: ``math-verify`` is not installed (the message names the extra).
    """
    try:
        from math_verify import parse
        from math_verify import verify as equal
    except ImportError:
        raise ImportError(
            "openaligner.tasks.math_answer needs the math-verify package: pip install 'openaligner[math]'"
        ) from None
    scores = []
    for i, (response, meta) in enumerate(zip(responses, metadata, strict=True)):
        key = ANSWER_KEY if ANSWER_KEY in meta else LABEL_KEY
        if meta.get(key) is None:
            raise KeyError(
                f"row {i} carries no {ANSWER_KEY!r} in its metadata (got {sorted(meta)}): give every prompt "
                f"record an {ANSWER_KEY!r} field and set data.metadata_keys=[{ANSWER_KEY}] in train-ppo (or "
                f"send the answer as the sample's label)"
            )
        gold = parse(_as_math(str(meta[key])))
        guess = parse(response)
        scores.append(1.0 if gold and guess and equal(gold, guess) else 0.0)
    return scores


def _as_math(answer: str) -> str:
    """A bare reference answer (``0.5``, ``1/2``) as math-verify parses it best: in ``$…$``."""
    text = answer.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"
