"""The reverse-text task: prompt layout, the LCS-ratio gold scorer on worked examples, deterministic
and disjoint train / held-out prompts, and the scorer served as a reward function."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from openaligner.tasks import TASK_EXACT, TASK_SCORERS, TASK_TARGETS, sorting, task_scorer
from openaligner.tasks import reverse_text as rt
from openaligner.tasks.reverse_text import (
    EXAMPLE_TEXT,
    UNSEEN_WORDS,
    WORDS,
    ReverseTextConfig,
    answer,
    extract_response,
    generated_word,
    gold_reward,
    gold_score,
    is_exact,
    is_held_out,
    lcs_length,
    lcs_ratio,
    make_prompt,
    mean_gold_score,
    parse_prompt,
    prompt_records,
    sft_records,
    sft_texts,
    texts,
    unseen_words_records,
    unseen_words_texts,
)

MADE_UP_WORDS = [f"zq{a}{b}x" for a in "abcdefgh" for b in "ijklmnop"]
"""64 made-up words, none near an unseen word: a vocabulary other than the task's."""


def test_prompt_layout_round_trips():
    p = make_prompt("blue whale")
    assert p == (
        "Reverse the characters of the text.\nText: good morning\nReversed: gninrom doog\n"
        "Text: blue whale\nReversed:"
    )
    assert parse_prompt(p) == "blue whale" and answer(p) == "elahw eulb"
    with pytest.raises(ValueError, match="not a reverse-text prompt"):
        parse_prompt("sort 1 2 :")


def test_lcs_worked_examples():
    assert lcs_length("abcd", "acbd") == 3  # "abd" (or "acd")
    assert lcs_length("abc", "") == 0 and lcs_length("", "") == 0
    assert lcs_length("abc", "xyz") == 0
    assert lcs_length("kitten", "sitting") == 4  # "ittn"
    # 2·3 / (4 + 4)
    assert lcs_ratio("abcd", "acbd") == 0.75
    assert lcs_ratio("", "") == 0.0


def test_gold_score_worked_examples():
    p = make_prompt("red fox")  # answer: "xof der" (7 characters)
    assert gold_score(p, " xof der") == 1.0  # exact reversal, after the space the prompt leaves
    assert gold_score(p, " xof der\nText: blue whale\nReversed: ...") == 1.0  # first line only
    assert gold_score(p, "") == 0.0
    assert gold_score(p, "\nxof der") == 0.0  # an empty first line is an empty answer
    assert gold_score(p, " qqq") == 0.0  # no character in common
    # unreversed: "red fox" and "xof der" share no two characters in the same order → LCS 1
    assert gold_score(p, " red fox") == pytest.approx(2 * 1 / 14)
    # one character dropped: LCS 6 of lengths 7 + 6
    assert gold_score(p, " xo der") == pytest.approx(12 / 13)
    # doubled: LCS 7 of lengths 7 + 14
    assert gold_score(p, " xof derxof der") == pytest.approx(14 / 21)


def test_extract_response_strips_only_the_separating_space_and_the_rest_of_the_output():
    assert extract_response("  ab c \nmore") == "ab c"
    assert extract_response("ab") == "ab"


def test_texts_are_deterministic_distinct_and_of_the_configured_length():
    cfg = ReverseTextConfig(min_words=2, max_words=4)
    a, b = texts(3, 200, held_out=False, cfg=cfg), texts(3, 200, held_out=False, cfg=cfg)
    assert a == b and len(set(a)) == 200
    assert texts(4, 200, held_out=False, cfg=cfg) != a  # another seed, other texts
    assert all(2 <= len(t.split()) <= 4 and set(t.split()) <= set(WORDS) for t in a)
    assert EXAMPLE_TEXT not in a


def test_held_out_texts_are_disjoint_from_train_texts_whatever_the_seeds():
    train = set(texts(0, 500, held_out=False)) | set(texts(1, 500, held_out=False))
    held = set(texts(0, 100, held_out=True)) | set(texts(7, 100, held_out=True))
    assert not train & held
    assert all(is_held_out(t) for t in held) and not any(is_held_out(t) for t in train)
    # about HELD_OUT_SHARE (1/8) of random texts fall in the held-out split
    rng = random.Random(0)
    share = sum(is_held_out(" ".join(rng.choice(WORDS) for _ in range(3))) for _ in range(4000)) / 4000
    assert 0.09 < share < 0.16


def test_records_carry_prompts_answers_and_demonstrations_the_scorer_rates_perfect():
    rows = prompt_records(0, 20, held_out=True)
    assert all(gold_score(r["prompt"], " " + r["answer"]) == 1.0 for r in rows)
    sft = sft_records(1, 20)
    assert mean_gold_score([r["prompt"] for r in sft], [r["response"] for r in sft]) == 1.0
    with pytest.raises(ValueError, match="distinct"):
        texts(0, len(set(WORDS)) + 1, held_out=False, cfg=ReverseTextConfig(min_words=1, max_words=1))


def test_the_task_scorer_registry_and_the_reward_function_agree():
    prompts = [make_prompt("red fox"), make_prompt("cold river")]
    responses = [" xof der", " revir"]
    direct = [gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]
    assert gold_reward(prompts, responses) == direct
    assert TASK_SCORERS["reverse_text"] is gold_score
    assert task_scorer("reverse_text")(prompts, responses) == direct


def test_served_as_a_reward_function_it_gives_the_numbers_of_a_direct_call():
    """``serve-reward reward.function=openaligner.tasks.reverse_text:gold_reward``: the function
    loaded in the server's worker processes, requests as a client sends them."""
    from openaligner.servers.reward_function import FunctionRunner, RewardFunctionEndpoint

    rows = prompt_records(5, 6, held_out=True)
    prompts = [r["prompt"] for r in rows]
    responses = [
        " " + rows[0]["answer"],
        "",
        " " + rows[2]["answer"][:-3],
        " nonsense",
        "\n",
        rows[5]["answer"],
    ]
    conversations = np.array(
        [
            [json.dumps([{"role": "user", "content": p}, {"role": "assistant", "content": r}]).encode()]
            for p, r in zip(prompts, responses, strict=True)
        ],
        dtype=np.object_,
    )
    runner = FunctionRunner("openaligner.tasks.reverse_text:gold_reward", timeout_s=60.0, workers=1)
    try:
        endpoint = RewardFunctionEndpoint(runner, name="openaligner.tasks.reverse_text:gold_reward")
        (out,) = endpoint.run([endpoint.validate({"messages": conversations})])
    finally:
        runner.close()
    served = out["rewards"].reshape(-1).tolist()
    direct = gold_reward(prompts, responses)
    assert served == pytest.approx(direct, abs=1e-6)  # the wire carries float32
    assert direct[0] == 1.0 and direct[1] == 0.0 and direct[5] == 1.0 and 0.0 < direct[2] < 1.0


def test_exact_means_the_first_line_is_the_reversal_and_the_lcs_score_rewards_a_forwards_copy():
    p = make_prompt("glass kind")
    assert is_exact(p, " dnik ssalg") and is_exact(p, " dnik ssalg\nText: more")
    assert not is_exact(p, " dnik ssal") and not is_exact(p, "")
    # the reward hack the LCS score cannot see: the words forwards, with more words around them
    for hack, lcs in ((" glass kind is a", 0.32), (" glass kind", 0.2)):
        assert not is_exact(p, hack) and gold_score(p, hack) == pytest.approx(lcs)
    hack = make_prompt("juice tiger cold")  # docs/real-model.md's second example: 0.30, not exact
    assert not is_exact(hack, " the tiger is cold") and gold_score(hack, " the tiger is cold") > 0.3
    assert TASK_EXACT["reverse_text"] is is_exact and TASK_TARGETS["reverse_text"](p) == "dnik ssalg"
    q = sorting.make_prompt([3, 1, 2])
    assert TASK_EXACT["sorting"](q, " 1 2 3") and not TASK_EXACT["sorting"](q, "1 2")
    assert TASK_TARGETS["sorting"](q) == "1 2 3"


def test_no_unseen_word_is_in_any_train_held_out_or_sft_text():
    cfg = ReverseTextConfig(min_words=2, max_words=3)
    assert not set(UNSEEN_WORDS) & set(WORDS) and EXAMPLE_TEXT.split()[0] not in UNSEEN_WORDS
    seen: set[str] = set()
    for seed in (0, 1, 2):
        seen |= {w for t in texts(seed, 400, held_out=False, cfg=cfg) for w in t.split()}
        seen |= {w for t in texts(seed, 100, held_out=True, cfg=cfg) for w in t.split()}
        for r in sft_records(seed, 3000, cfg):
            seen |= set(parse_prompt(r["prompt"]).split())
    assert not seen & set(UNSEEN_WORDS)
    unseen = unseen_words_texts(0, 128, cfg)
    assert all(set(t.split()) <= set(UNSEEN_WORDS) and 2 <= len(t.split()) <= 3 for t in unseen)
    assert unseen == unseen_words_texts(0, 128, cfg) != unseen_words_texts(1, 128, cfg)
    rows = unseen_words_records(0, 8, cfg)
    assert all(r["answer"] == parse_prompt(r["prompt"])[::-1] for r in rows)


def test_the_sft_generator_skips_unseen_words_it_would_otherwise_draw(monkeypatch):
    """The exclusion is real: words the generator draws, declared unseen, are never drawn again."""
    rng = random.Random(5)
    first_fifty = [generated_word(rng) for _ in range(50)]
    monkeypatch.setattr(rt, "UNSEEN_WORDS", tuple(first_fifty))
    rng = random.Random(5)
    again = {generated_word(rng) for _ in range(2000)}
    assert not again & set(first_fifty)


def test_sft_texts_are_train_split_varied_and_mostly_generated_words():
    cfg = ReverseTextConfig(min_words=2, max_words=3)
    chosen = sft_texts(0, 2000, cfg)
    assert len(set(chosen)) == 2000 and not any(is_held_out(t) for t in chosen)
    words = [w for t in chosen for w in t.split()]
    task_share = sum(w in WORDS for w in words) / len(words)
    assert 0.15 < task_share < 0.35  # SFT_TASK_WORD_SHARE (0.25), with some generated words in WORDS
    assert len(set(words) - set(WORDS)) > 2500  # an open vocabulary: recall cannot pass
    assert all(3 <= len(w) <= 8 for w in words if w not in WORDS)
    # the task's own words only, for comparison (what a model passes by recall)
    task = sft_records(0, 50, cfg, vocabulary="task")
    assert all(set(parse_prompt(r["prompt"]).split()) <= set(WORDS) for r in task)
    with pytest.raises(ValueError, match="vocabulary"):
        sft_records(0, 5, cfg, vocabulary="other")


def test_generated_words_are_never_near_an_unseen_word():
    # about one draw in 1,400 used to be a piece of an unseen word ("pilo", "jung", "deser"):
    # demonstrations of it teach part of that word's reversal, and the split is no longer unseen
    rng = random.Random(0)
    near = [w for w in (rt.generated_word(rng) for _ in range(20000)) if rt._near_unseen(w)]
    assert near == []


def test_sft_records_refuse_settings_their_vocabulary_would_ignore():
    cfg = ReverseTextConfig(min_words=1, max_words=3)
    with pytest.raises(ValueError, match="task_word_share"):  # "task" is a share of 1 by definition
        sft_records(0, 5, cfg, vocabulary="task", task_word_share=0.0)
    with pytest.raises(ValueError, match="neither words"):
        sft_records(0, 5, cfg, vocabulary="task", words=MADE_UP_WORDS)
    with pytest.raises(ValueError, match='vocabulary="words"'):  # given words, silently unused
        sft_records(0, 5, cfg, vocabulary="generated", words=MADE_UP_WORDS)
    # the default share is still the documented one, and an explicit share still applies
    default = [w for r in sft_records(0, 300, cfg) for w in parse_prompt(r["prompt"]).split()]
    assert 0.15 < sum(w in WORDS for w in default) / len(default) < 0.35
    none = sft_records(0, 50, cfg, task_word_share=0.0)
    assert not any(set(parse_prompt(r["prompt"]).split()) & set(WORDS) for r in none)


def test_vocabulary_words_keep_whole_lower_case_words_and_nothing_near_an_unseen_word():
    tokens = [
        "\u2581copper", "\u2581coppers", "\u2581cabinet", "\u2581lant", "\u2581can",  # unseen or near one
        "\u2581window", "\u0120pencil",  # unseen, either marker
        "\u2581cargo", "\u0120brick", " stove", "\u2581Table", "\u2581caf\u00e9", "\u2581ab",
        "\u2581overlong1", "\u2581toolongword", "cargo", "ing", "\u2581dans",
    ]  # fmt: skip
    # "can" is shorter than 4 letters: a different word, not part of "candle"'s spelling
    assert rt.vocabulary_words(tokens) == ["can", "cargo", "brick", "stove", "dans"]  # in the order given
    assert rt.vocabulary_words(["\u2581cargo", "\u0120cargo"]) == ["cargo"]
    assert not rt._near_unseen("stove") and rt._near_unseen("rockets") and rt._near_unseen("gard")


def test_sft_texts_of_vocabulary_words_use_those_words_and_refuse_one_near_an_unseen_word():
    cfg = ReverseTextConfig(min_words=1, max_words=3)
    vocab = MADE_UP_WORDS
    rows = sft_records(3, 300, cfg, vocabulary="words", words=vocab)
    used = [w for r in rows for w in parse_prompt(r["prompt"]).split()]
    assert set(used) <= set(vocab) | set(WORDS) and len(set(used) & set(vocab)) > 50
    assert 0.15 < sum(w in WORDS for w in used) / len(used) < 0.35
    assert all(r["response"] == " " + parse_prompt(r["prompt"])[::-1] for r in rows)
    assert not any(is_held_out(parse_prompt(r["prompt"])) for r in rows)
    assert {len(parse_prompt(r["prompt"]).split()) for r in rows} == {1, 2, 3}
    with pytest.raises(ValueError, match="unseen word"):
        sft_records(3, 10, cfg, vocabulary="words", words=[*vocab, "coppers"])
    with pytest.raises(ValueError, match="needs words"):  # not a silent fall-back to generated strings
        sft_records(3, 10, cfg, vocabulary="words")


def test_task_word_share_sets_how_many_task_words_sft_texts_hold():
    cfg = ReverseTextConfig(min_words=2, max_words=3)
    vocab = MADE_UP_WORDS
    for share in (0.0, 0.5):
        used = [w for t in sft_texts(4, 400, cfg, vocab, task_word_share=share) for w in t.split()]
        assert abs(sum(w in WORDS for w in used) / len(used) - share) < 0.06
    rows = sft_records(4, 50, cfg, vocabulary="words", words=vocab, task_word_share=0.0)
    assert all(set(parse_prompt(r["prompt"]).split()) <= set(vocab) for r in rows)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="task_word_share"):
            sft_texts(4, 10, cfg, vocab, task_word_share=bad)


def test_prompt_records_of_other_words_keep_the_splits_and_refuse_an_unseen_word():
    cfg = ReverseTextConfig(min_words=2, max_words=3)
    vocab = MADE_UP_WORDS
    train = prompt_records(2, 200, False, cfg, vocab)
    held = prompt_records(2, 30, True, cfg, vocab)
    for rows, held_out in ((train, False), (held, True)):
        assert all(set(parse_prompt(r["prompt"]).split()) <= set(vocab) for r in rows)
        assert all(is_held_out(parse_prompt(r["prompt"])) == held_out for r in rows)
        assert all(r["answer"] == parse_prompt(r["prompt"])[::-1] for r in rows)
    assert texts(2, 20, False, cfg) == texts(2, 20, False, cfg, WORDS)  # the default is unchanged
    with pytest.raises(ValueError, match="unseen word"):
        prompt_records(2, 10, False, cfg, [*vocab, "maple"])


def test_spelled_prompts_grade_only_the_reversed_line_after_the_scratchpad():
    text = "kitten ginger"
    prompt = rt.make_spelled_prompt(text)
    assert rt.is_spelled(prompt) and not rt.is_spelled(make_prompt(text))
    assert parse_prompt(prompt) == text and answer(prompt) == "regnig nettik"
    right = rt.spelled_response(text)
    assert right == (
        " k i t t e n / g i n g e r\nReversed letters: r e g n i g / n e t t i k\nReversed: regnig nettik"
    )
    assert rt.spell("go ab") == "g o / a b"
    assert gold_score(prompt, right) == 1.0 and is_exact(prompt, right)
    assert rt.extract_answer(prompt, right + "\nText: more") == "regnig nettik"
    # the scratchpad alone is no answer, however right its letters
    scratch_only = right.rsplit("\n", 1)[0]
    assert rt.extract_answer(prompt, scratch_only) == "" and gold_score(prompt, scratch_only) == 0.0
    # a forwards answer after a right scratchpad scores the LCS ratio and is not exact
    forwards = scratch_only + "\nReversed: kitten ginger"
    assert 0.0 < gold_score(prompt, forwards) < 1.0 and not is_exact(prompt, forwards)
    # the first line of a spelled response (its letters) is not what is graded
    assert gold_score(prompt, " regnig nettik") == 0.0
    # a plain prompt still grades its first line
    assert rt.extract_answer(make_prompt(text), right) == extract_response(right)


def test_spelled_records_keep_the_plain_records_texts_and_their_demonstrations_score_perfect():
    cfg = ReverseTextConfig(min_words=1, max_words=3)
    for plain, spelled in [
        (rt.prompt_records(0, 8, True, cfg), rt.prompt_records(0, 8, True, cfg, spelled=True)),
        (rt.unseen_words_records(0, 8, cfg), rt.unseen_words_records(0, 8, cfg, spelled=True)),
    ]:
        assert [parse_prompt(r["prompt"]) for r in plain] == [parse_prompt(r["prompt"]) for r in spelled]
        assert [r["answer"] for r in plain] == [r["answer"] for r in spelled]
        assert all(rt.is_spelled(r["prompt"]) for r in spelled)
    kwargs = {"vocabulary": "words", "words": MADE_UP_WORDS, "task_word_share": 0.0}
    demos = rt.sft_records(3, 16, cfg, spelled=True, **kwargs)
    plain_demos = rt.sft_records(3, 16, cfg, **kwargs)
    assert [parse_prompt(d["prompt"]) for d in demos] == [parse_prompt(d["prompt"]) for d in plain_demos]
    for d in demos:
        assert d["response"] == rt.spelled_response(parse_prompt(d["prompt"]))
        assert gold_score(d["prompt"], d["response"]) == 1.0


def test_spelled_stages_judge_each_line_against_the_responses_own_previous_line():
    prompt = rt.make_spelled_prompt("kitten ginger")
    assert rt.spelled_stages(prompt, rt.spelled_response("kitten ginger")) == {
        "words": 2, "words_spelled": 2, "reversed_own": 1, "joined_own": 1,
    }  # fmt: skip
    # "kitten" misspelt, then reversed and joined faithfully: only the spelling is wrong
    own = " k e t e k / g i n g e r\nReversed letters: r e g n i g / k e t e k\nReversed: regnig ketek"
    assert rt.spelled_stages(prompt, own) == {
        "words": 2,
        "words_spelled": 1,
        "reversed_own": 1,
        "joined_own": 1,
    }
    assert not is_exact(prompt, own)
    # right letters, a letter lost in the reversal and another in the join
    lossy = " k i t t e n / g i n g e r\nReversed letters: r e g n i / n e t t i k\nReversed: regni netik"
    assert rt.spelled_stages(prompt, lossy) == {
        "words": 2,
        "words_spelled": 2,
        "reversed_own": 0,
        "joined_own": 0,
    }
    # the scratchpad alone: its lines are judged, the missing answer is wrong
    assert rt.spelled_stages(prompt, own.rsplit("\n", 1)[0])["joined_own"] == 0
    with pytest.raises(ValueError, match="not a spelled prompt"):
        rt.spelled_stages(make_prompt("kitten ginger"), own)


def test_spelling_drills_spell_every_word_once_before_any_twice_and_are_never_graded():
    words = [f"w{chr(97 + i)}{chr(97 + j)}" for i in range(5) for j in range(5)]  # 25 words
    rows = rt.spelling_records(3, 9, words, words_per_text=6)  # 54 words: two passes and a bit
    drawn = [r["prompt"].split("Text: ")[1].split("\n")[0].split() for r in rows]
    flat = [w for text in drawn for w in text]
    assert sorted(flat[:25]) == sorted(words) and sorted(flat[25:50]) == sorted(words)
    assert all(len(set(text)) == 6 for text in drawn)  # no word twice in one drill
    for row, text in zip(rows, drawn, strict=True):
        assert row["prompt"].startswith(rt.SPELLING_INSTRUCTION)
        assert row["response"] == " " + rt.spell(" ".join(text))
        # a drill is not a reverse-text prompt: never graded as a reversal
        assert not rt.is_spelled(row["prompt"])
        with pytest.raises(ValueError, match="not a reverse-text prompt"):
            parse_prompt(row["prompt"])
    assert rows == rt.spelling_records(3, 9, words, words_per_text=6)  # deterministic
    assert rows != rt.spelling_records(4, 9, words, words_per_text=6)
    with pytest.raises(ValueError, match="unseen word"):
        rt.spelling_records(0, 2, [*words, "coppers"])
    with pytest.raises(ValueError, match="6 distinct words"):
        rt.spelling_records(0, 2, ["ab", "cd", "ab"])
    with pytest.raises(ValueError, match="at least 1"):
        rt.spelling_records(0, 2, words, words_per_text=0)
