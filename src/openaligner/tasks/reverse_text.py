"""The built-in "reverse the text" task (prime-rl's reverse-text): prompts, held-out prompts, a
gold scorer. Owns the prompt text (plain: one worked example, then the text, answered on one
line; spelled: the text, answered after a scratchpad of its letters and their reversal), the gold
score (the longest-common-subsequence ratio in [0, 1] of the graded answer), the exact-task check
(the graded answer is the reversal), and three splits: train and held-out combinations of
:data:`WORDS` or other words (by each text's sha256, disjoint whatever the seed), and unseen
words (texts made only of :data:`UNSEEN_WORDS`, which no other text contains). SFT texts are of
generated letter strings or the model's one-token words (and a share of :data:`WORDS`): reversing
them takes spelling, not recall. Deterministic from a seed. Must not know models or training.
Design notes: docs/demo.md, "Module notes".
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

INSTRUCTION = "Reverse the characters of the text."
TEXT_LABEL = "Text:"
ANSWER_LABEL = "Reversed:"
SPELLED_INSTRUCTION = "Reverse the characters of the text: spell it, reverse the letters, join them."
"""The first line of a spelled prompt (:func:`make_spelled_prompt`)."""
LETTERS_LABEL = "Letters:"
SPELLING_INSTRUCTION = "Spell the text letter by letter."
"""The first line of a spelling drill (:func:`spelling_records`): SFT only, never graded."""
REVERSED_LETTERS_LABEL = "Reversed letters:"
EXAMPLE_TEXT = "good morning"
"""The worked example in every prompt (two words not in :data:`WORDS`, so that no prompt's text is
the example)."""
HELD_OUT_SHARE = 0.125
"""The share of all texts that belongs to the held-out split."""

WORDS: tuple[str, ...] = (
    "apple", "bright", "cloud", "dance", "eager", "field", "green", "house", "island", "jolly",
    "kind", "light", "music", "night", "ocean", "paper", "quiet", "river", "stone", "table",
    "under", "voice", "water", "yellow", "zebra", "bread", "chair", "dream", "earth", "flame",
    "glass", "heart", "juice", "knife", "lemon", "mouse", "north", "olive", "plant", "queen",
    "robot", "sugar", "tiger", "uncle", "video", "whale", "young", "smile", "train", "winter",
    "the", "a", "of", "and", "holds", "finds", "sees", "makes", "over", "near", "seven",
    "three", "small", "old", "red", "blue", "warm", "cold", "fast", "slow", "happy", "little",
)  # fmt: skip
"""Words the texts are made of: common, lower-case, ASCII (so characters and bytes agree)."""

UNSEEN_WORDS: tuple[str, ...] = (
    "purple", "lantern", "copper", "maple", "rocket", "forest", "candle", "silver", "garden", "window",
    "pencil", "marble", "basket", "button", "castle", "dragon", "feather", "jacket", "kettle", "ladder",
    "mirror", "needle", "orange", "pepper", "rabbit", "saddle", "tunnel", "violet", "wagon", "bottle",
    "cotton", "desert", "engine", "finger", "ginger", "honey", "insect", "jungle", "kitten", "lizard",
    "banana", "tomato", "potato", "salami", "domino", "cabin", "melon", "pilot", "robin", "tulip",
)  # fmt: skip
"""Words of the unseen-words split only: no train, held-out or SFT text holds one (some, like
"banana", are also letter strings the SFT generator could draw; it skips them). A model that
reverses these reverses text; one that passes only the held-out combinations of :data:`WORDS`
may be recalling the reversed spelling of each training word."""

_ONSETS = (
    "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
    "br", "ch", "cl", "dr", "fl", "gr", "pl", "sh", "st", "tr", "",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "k", "x", "ng")
SFT_TASK_WORD_SHARE = 0.25
"""The share of an SFT text's words drawn from :data:`WORDS` (the rest are generated strings)."""


@dataclass(frozen=True)
class ReverseTextConfig:
    min_words: int = 2  # fewest words in a text
    max_words: int = 5  # most words in a text (5 words: about 30 characters)


def make_prompt(text: str) -> str:
    """The plain-text prompt for ``text`` (one worked example, then ``text``; ends with ``Reversed:``)."""
    return "\n".join(
        [INSTRUCTION, f"{TEXT_LABEL} {EXAMPLE_TEXT}", f"{ANSWER_LABEL} {EXAMPLE_TEXT[::-1]}",
         f"{TEXT_LABEL} {text}", ANSWER_LABEL]
    )  # fmt: skip


def spell(text: str) -> str:
    """``text`` letter by letter: its letters apart, its words apart by ``" / "``
    (``spell("ab cd") == "a b / c d"``). Each spaced letter is one token to most tokenizers, so a
    model that spells a word has read its token's letters, and reversing the letters is then a
    matter of copying tokens in reverse order."""
    return " / ".join(" ".join(word) for word in text.split())


def make_spelled_prompt(text: str) -> str:
    """The spelled prompt for ``text``: :data:`SPELLED_INSTRUCTION`, the text, and ``Letters:``; the
    answer follows a scratchpad (:func:`spelled_response`). No worked example: the format is taught
    by SFT (``sft_records(..., spelled=True)``), which keeps each demonstration short."""
    return _letters_prompt(SPELLED_INSTRUCTION, text)


def _letters_prompt(instruction: str, text: str) -> str:
    """``instruction``, ``Text: text`` and ``Letters:``: the frame a spelled prompt and a spelling
    drill share, so that a drill practises the spelled answer's first line in its own context."""
    return "\n".join([instruction, f"{TEXT_LABEL} {text}", LETTERS_LABEL])


def spelled_response(text: str) -> str:
    """The spelled answer to ``text``: its letters, the letters reversed, then the reversal on the
    ``Reversed:`` line, the one graded (``" g o / a b\nReversed letters: b a / o g\nReversed: ba og"``
    for ``"go ab"``)."""
    return f" {spell(text)}\n{REVERSED_LETTERS_LABEL} {spell(text[::-1])}\n{ANSWER_LABEL} {text[::-1]}"


def spelled_stages(prompt: str, response: str) -> dict[str, int]:
    """Where a spelled ``response`` to ``prompt`` goes right, each stage judged against the
    response's own previous line: ``words`` (of the text), ``words_spelled`` (spelt right on the
    ``Letters`` line, word by word), ``reversed_own`` (1 when the ``Reversed letters`` line is the
    reversal of the response's own letters), ``joined_own`` (1 when the answer is the join of its own
    reversed letters). A missing line counts as wrong.

    Raises:
        ValueError: ``prompt`` is not a spelled prompt.
    """
    if not is_spelled(prompt):
        raise ValueError(f"not a spelled prompt: {prompt!r}")
    text = parse_prompt(prompt)
    lines = response.split("\n")
    own = lines[0].strip(" ").split(" / ")

    def line_after(label: str) -> str | None:
        return next((ln[len(label) :].strip(" ") for ln in lines if ln.startswith(label)), None)

    reversed_line = line_after(REVERSED_LETTERS_LABEL)
    own_reversed = " / ".join(" ".join(word.split(" ")[::-1]) for word in own[::-1])
    joined = (
        None if reversed_line is None else " ".join(w.replace(" ", "") for w in reversed_line.split(" / "))
    )
    return {
        "words": len(text.split()),
        "words_spelled": sum(a == " ".join(w) for w, a in zip(text.split(), own, strict=False)),
        "reversed_own": int(reversed_line == own_reversed),
        "joined_own": int(joined is not None and line_after(ANSWER_LABEL) == joined),
    }


def is_spelled(prompt: str) -> bool:
    """Whether ``prompt`` asks for the spelled format (holds :data:`SPELLED_INSTRUCTION` and ends
    with ``Letters:``; a spelling drill, :func:`spelling_records`, ends so too but is no reverse-text
    prompt)."""
    return SPELLED_INSTRUCTION in prompt and prompt.rstrip().endswith(LETTERS_LABEL)


def parse_prompt(prompt: str) -> str:
    """The text a prompt (plain or spelled) asks to reverse: what follows its last ``Text:`` up to
    the line break.

    Raises:
        ValueError: ``prompt`` is not a reverse-text prompt.
    """
    label = LETTERS_LABEL if is_spelled(prompt) else ANSWER_LABEL
    start = prompt.rfind(f"\n{TEXT_LABEL} ")
    end = prompt.find(f"\n{label}", start + 1)
    if start < 0 or end < 0 or not prompt.rstrip().endswith(label):
        raise ValueError(f"not a reverse-text prompt: {prompt!r}")
    return prompt[start + len(TEXT_LABEL) + 2 : end]


def answer(prompt: str) -> str:
    return parse_prompt(prompt)[::-1]


def is_exact(prompt: str, response: str) -> bool:
    """Whether ``response`` does the task: its graded answer (:func:`extract_answer`) is exactly the
    reversal. The gold score rewards partial overlap; this does not (a forwards copy scores > 0
    on the LCS ratio and is never exact)."""
    return extract_answer(prompt, response) == answer(prompt)


def extract_answer(prompt: str, response: str) -> str:
    """What is graded of ``response`` to ``prompt``: for a plain prompt its first line
    (:func:`extract_response`); for a spelled one (:func:`is_spelled`) what follows the first line
    of it that starts with ``Reversed:`` ("" when there is none: the scratchpad alone is not an
    answer, however right its letters)."""
    if not is_spelled(prompt):
        return extract_response(response)
    for line in response.split("\n"):
        if line.startswith(ANSWER_LABEL):
            return line[len(ANSWER_LABEL) :].strip(" ")
    return ""


def extract_response(response: str) -> str:
    """What is graded: the response's first line, without the space after ``Reversed:``.

    A base model rarely emits its end token after a plain-text answer; it goes on with the next
    ``Text:`` line. Grading only the first line keeps that from diluting a right answer.
    """
    return response.lstrip(" ").split("\n", 1)[0].rstrip()


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (dynamic programming over one row).

    Example: ``lcs_length("abcd", "acbd") == 3`` ("abd" or "acd").
    """
    if len(b) > len(a):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ca in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, cb in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if ca == cb else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


def lcs_ratio(reference: str, response: str) -> float:
    """``2·LCS / (len(reference) + len(response))``: 1.0 when equal, 0.0 when either is empty."""
    total = len(reference) + len(response)
    return 2.0 * lcs_length(reference, response) / total if total else 0.0


def gold_score(prompt: str, response: str) -> float:
    """The LCS ratio (0–1) of ``response``'s graded answer (:func:`extract_answer`) to the reversal
    of the prompt's text."""
    return lcs_ratio(answer(prompt), extract_answer(prompt, response))


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The gold scorer as a reward function for ``serve-reward reward.function=
    openaligner.tasks.reverse_text:gold_reward``: :func:`gold_score` of each row."""
    return [gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]


def mean_gold_score(prompts: Sequence[str], responses: Sequence[str]) -> float:
    return sum(gold_score(p, r) for p, r in zip(prompts, responses, strict=True)) / max(len(prompts), 1)


def is_held_out(text: str) -> bool:
    """Whether ``text`` belongs to the held-out split (a fixed property of the text itself)."""
    return hashlib.sha256(text.encode()).digest()[0] < HELD_OUT_SHARE * 256


def random_text(rng: random.Random, cfg: ReverseTextConfig, words: Sequence[str] = WORDS) -> str:
    """A text of ``cfg.min_words`` to ``cfg.max_words`` words drawn from ``words`` (with repeats)."""
    return " ".join(rng.choice(words) for _ in range(rng.randint(cfg.min_words, cfg.max_words)))


def _distinct(n: int, split: str, draw: Callable[[], str], keep: Callable[[str], bool]) -> list[str]:
    """``n`` distinct results of ``draw()`` that ``keep`` accepts, in the order drawn.

    Raises:
        ValueError: fewer than ``n`` after 1000·n draws (the split has too few distinct texts).
    """
    out: dict[str, None] = {}  # insertion-ordered set
    for _ in range(1000 * max(n, 1)):
        if len(out) == n:
            break
        text = draw()
        if keep(text):
            out.setdefault(text)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} texts; asked {n}")
    return list(out)


def texts(
    seed: int,
    n: int,
    held_out: bool,
    cfg: ReverseTextConfig = ReverseTextConfig(),
    words: Sequence[str] = WORDS,
) -> list[str]:
    """``n`` distinct texts of ``words`` (default :data:`WORDS`) of one split (train or held-out
    combinations), reproducible from ``seed``.

    Raises:
        ValueError: the split has fewer than ``n`` distinct texts to draw from, or ``words`` holds
            a word near an unseen word (the unseen-words split would no longer be unseen).
    """
    _refuse_near_unseen(words, "text")
    split = "held-out" if held_out else "train"
    rng = random.Random(f"reverse-text/{seed}/{split}")
    return _distinct(n, split, lambda: random_text(rng, cfg, words), lambda t: is_held_out(t) == held_out)


def unseen_words_texts(seed: int, n: int, cfg: ReverseTextConfig = ReverseTextConfig()) -> list[str]:
    """``n`` distinct texts made only of :data:`UNSEEN_WORDS` (the unseen-words split), reproducible
    from ``seed``.

    Raises:
        ValueError: fewer than ``n`` distinct texts can be drawn.
    """
    rng = random.Random(f"reverse-text/{seed}/unseen-words")
    return _distinct(n, "unseen-words", lambda: random_text(rng, cfg, UNSEEN_WORDS), lambda t: True)


def generated_word(rng: random.Random) -> str:
    """A pronounceable lower-case letter string of 1–3 syllables and 3–8 letters (e.g. ``"brelzain"``;
    as long as the task's words, so that reversals fit the same response budget), never one of
    :data:`UNSEEN_WORDS` nor near one (:func:`_near_unseen`: "pilo", "jung", "deser" — about one
    draw in 1,400 — would teach part of an unseen word's reversal): the SFT demonstrations' open
    vocabulary (over 10⁵ distinct strings, so a model cannot pass the unseen words by recalling
    reversed spellings it was shown)."""
    while True:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))
        )
        if 3 <= len(word) <= 8 and not _near_unseen(word):
            return word


def prompt_records(
    seed: int,
    n: int,
    held_out: bool,
    cfg: ReverseTextConfig = ReverseTextConfig(),
    words: Sequence[str] = WORDS,
    spelled: bool = False,
) -> list[dict[str, str]]:
    """Prompt records (``{"prompt", "answer"}``) for train-ppo's ``data.prompts`` JSONL or evaluation,
    of texts of ``words`` (:func:`texts`); ``answer`` is the reversal, for metadata-reading reward
    functions and for reading results. ``spelled``: spelled prompts (:func:`make_spelled_prompt`),
    the same texts."""
    chosen = texts(seed, n, held_out, cfg, words)
    return [{"prompt": _prompt(t, spelled), "answer": t[::-1]} for t in chosen]


def unseen_words_records(
    seed: int, n: int, cfg: ReverseTextConfig = ReverseTextConfig(), spelled: bool = False
) -> list[dict[str, str]]:
    """Prompt records (``{"prompt", "answer"}``, as :func:`prompt_records`) of the unseen-words split."""
    return [{"prompt": _prompt(t, spelled), "answer": t[::-1]} for t in unseen_words_texts(seed, n, cfg)]


def _prompt(text: str, spelled: bool) -> str:
    return make_spelled_prompt(text) if spelled else make_prompt(text)


def sft_texts(
    seed: int,
    n: int,
    cfg: ReverseTextConfig = ReverseTextConfig(),
    words: Sequence[str] = (),
    task_word_share: float = SFT_TASK_WORD_SHARE,
) -> list[str]:
    """``n`` distinct train-split texts for SFT: each word, with probability ``task_word_share``, a
    word of :data:`WORDS`, otherwise one of ``words`` (e.g. :func:`vocabulary_words`) or, when
    ``words`` is empty, a :func:`generated_word`; none holds an unseen word.

    Raises:
        ValueError: fewer than ``n`` distinct texts can be drawn, ``task_word_share`` outside [0, 1],
            or ``words`` holds an unseen word or a word near one (the unseen-words split would no
            longer be unseen).
    """
    if not 0.0 <= task_word_share <= 1.0:
        raise ValueError(f"task_word_share must lie in [0, 1], got {task_word_share}")
    _refuse_near_unseen(words, "SFT")
    rng = random.Random(f"reverse-text/{seed}/sft")

    def word() -> str:
        if rng.random() < task_word_share:
            return rng.choice(WORDS)
        return rng.choice(words) if words else generated_word(rng)

    def draw() -> str:
        return " ".join(word() for _ in range(rng.randint(cfg.min_words, cfg.max_words)))

    return _distinct(n, "SFT", draw, lambda t: not is_held_out(t))


def _near_unseen(word: str) -> bool:
    """Whether ``word`` holds an unseen word ("coppers", "cabinet") or, at 4 letters or more, lies
    inside one ("lant"): spelling either would teach part of an unseen word's reversal."""
    return any(u in word or (len(word) >= 4 and word in u) for u in UNSEEN_WORDS)


def _refuse_near_unseen(words: Sequence[str], what: str) -> None:
    """Raise ``ValueError`` naming the first few of ``words`` near an unseen word (the
    unseen-words split would no longer be unseen)."""
    near = [w for w in words if _near_unseen(w)]
    if near:
        raise ValueError(f"{what} words must not hold or lie inside an unseen word, got {near[:5]}")


def vocabulary_words(tokens: Iterable[str]) -> list[str]:
    """The whole words among a tokenizer's vocabulary, in the order given, each once: tokens of a
    word-start marker (SentencePiece's ``▁``, byte-level BPE's ``Ġ``) or a space and then 3–8
    lower-case ASCII letters, without :data:`UNSEEN_WORDS` or any word near one
    (:func:`_near_unseen`). Each is one token to the model, as the unseen words are: reversing it
    takes the model's knowledge of how the token is spelt — the skill the unseen-words split grades.
    Give the tokens in id order (``sorted(vocab, key=vocab.get)``) and keep the first few thousand
    for the commonest words (a BPE vocabulary's ids follow its merges, frequent pieces first).
    """
    out: dict[str, None] = {}  # insertion-ordered set
    for token in tokens:
        if token[:1] in ("\u2581", "\u0120", " "):
            word = token[1:]
            whole = 3 <= len(word) <= 8 and word.isascii() and word.isalpha() and word.islower()
            if whole and not _near_unseen(word):
                out.setdefault(word)
    return list(out)


def sft_records(
    seed: int,
    n: int,
    cfg: ReverseTextConfig = ReverseTextConfig(),
    vocabulary: str = "generated",
    words: Sequence[str] = (),
    task_word_share: float | None = None,
    spelled: bool = False,
) -> list[dict[str, str]]:
    """SFT demonstrations (``{"prompt", "response"}``): the exact reversal after a space (with
    ``spelled``, a spelled prompt and :func:`spelled_response`: letters, reversed letters, answer),
    on train-split texts only. ``vocabulary="generated"`` (the default) draws them from
    :func:`sft_texts` (generated letter strings and some task words: reversing them takes
    spelling); ``"task"`` from :data:`WORDS` alone (:func:`texts`), which a model can pass by
    recalling each word's reversal, so it learns the held-out combinations and not the unseen
    words; ``"words"`` from ``words`` (the model's own single-token words,
    :func:`vocabulary_words`, thousands of them) and some task words — real words, one token each,
    as the unseen words are. ``task_word_share`` (``"generated"`` and ``"words"``; None:
    :data:`SFT_TASK_WORD_SHARE`): the share of words drawn from :data:`WORDS` (0: none, so the
    held-out combinations are not recalled from SFT). Give another ``seed`` than the RL prompts' to
    get other texts.

    Raises:
        ValueError: an unknown ``vocabulary``, ``"words"`` without ``words``, ``words`` or
            ``task_word_share`` where ``vocabulary`` does not use them (``"task"`` draws task words
            only; ``"generated"`` draws no given words: either would be ignored without a word
            said), or too few distinct texts.
    """
    share = SFT_TASK_WORD_SHARE if task_word_share is None else task_word_share
    if vocabulary == "generated":
        if words:
            raise ValueError(
                'vocabulary="generated" draws no given words; pass vocabulary="words" to use them'
            )
        chosen = sft_texts(seed, n, cfg, task_word_share=share)
    elif vocabulary == "task":
        if words or task_word_share is not None:
            raise ValueError(
                'vocabulary="task" draws the task\'s words only (a task-word share of 1): it takes '
                f"neither words nor task_word_share, got words={list(words)[:3]}, "
                f"task_word_share={task_word_share}"
            )
        chosen = texts(seed, n, held_out=False, cfg=cfg)
    elif vocabulary == "words":
        if not words:  # else it would fall back to generated strings without a word said
            raise ValueError('vocabulary="words" needs words (e.g. from vocabulary_words), got none')
        chosen = sft_texts(seed, n, cfg, words, share)
    else:
        raise ValueError(f'vocabulary must be "generated", "task" or "words", got {vocabulary!r}')
    if spelled:
        return [{"prompt": make_spelled_prompt(t), "response": spelled_response(t)} for t in chosen]
    return [{"prompt": make_prompt(t), "response": " " + t[::-1]} for t in chosen]


def spelling_records(
    seed: int, n: int, words: Sequence[str], words_per_text: int = 6
) -> list[dict[str, str]]:
    """``n`` spelling drills for SFT (``{"prompt", "response"}``): the prompt is
    :data:`SPELLING_INSTRUCTION`, a text of ``words_per_text`` of ``words`` and ``Letters:``; the
    response is the text spelt as the spelled format's first line (``" k i t / o n"``, :func:`spell`).
    They teach the one stage of a spelled answer a model cannot do for words it was not shown —
    reading a token's letters (docs/real-model.md, "Spelled answers") — at six words a drill against
    a spelled reversal's one to three. Every word is used once before any is used again (breadth over
    the vocabulary, not repeats). Not reverse-text prompts: :func:`is_spelled` and
    :func:`parse_prompt` refuse them, so they are never graded as reversals.

    Raises:
        ValueError: ``words_per_text`` < 1, fewer words than one text takes, or ``words`` holds an
            unseen word or a word near one (the unseen-words split would no longer be unseen).
    """
    if words_per_text < 1:
        raise ValueError(f"words_per_text must be at least 1, got {words_per_text}")
    distinct = list(dict.fromkeys(words))
    if len(distinct) < words_per_text:
        raise ValueError(f"a drill takes {words_per_text} distinct words, got {len(distinct)}")
    _refuse_near_unseen(distinct, "spelling")
    rng = random.Random(f"reverse-text/{seed}/spelling")
    queue: deque[str] = deque()  # the words to come: passes over every word, each in its own order
    rows = []
    for _ in range(n):
        chosen: list[str] = []
        deferred: list[str] = []  # a word already in this text (at a pass's end) waits for the next
        while len(chosen) < words_per_text:
            if not queue:
                order = distinct.copy()
                rng.shuffle(order)
                queue.extend(order)
            word = queue.popleft()
            (deferred if word in chosen else chosen).append(word)
        queue.extendleft(reversed(deferred))
        text = " ".join(chosen)
        rows.append({"prompt": _letters_prompt(SPELLING_INSTRUCTION, text), "response": " " + spell(text)})
    return rows
