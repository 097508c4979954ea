import pytest

from openaligner.tasks.sorting import (
    SortingTaskConfig,
    answer,
    generate_task_data,
    gold_score,
    make_prompt,
    mean_gold_score,
    parse_prompt,
)


def test_gold_score_worked_examples():
    p = make_prompt([5, 2, 8, 1])
    assert p == "sort 5 2 8 1 :"
    assert parse_prompt(p) == [5, 2, 8, 1] and answer(p) == "1 2 5 8"
    assert gold_score(p, "1 2 5 8") == 100.0
    # positions 0 and 3 match the answer "1 2 5 8" → 2/4
    assert gold_score(p, "1 5 2 8") == 50.0
    # a missing digit: 3 of max(3, 4) positions match → 75
    assert gold_score(p, "1 2 5") == 75.0
    # an extra digit: 4 of max(5, 4) = 80
    assert gold_score(p, "1 2 5 8 9") == 80.0
    assert gold_score(p, "") == 0.0
    with pytest.raises(ValueError, match="not a sorting prompt"):
        parse_prompt("hello")


def test_data_is_deterministic_and_middling():
    a = generate_task_data(0, n_sft=400, n_pref=300, n_ppo=10, n_val=10)
    b = generate_task_data(0, n_sft=400, n_pref=300, n_ppo=10, n_val=10)
    assert a == b
    sft_gold = mean_gold_score([r["prompt"] for r in a.sft], [r["response"] for r in a.sft])
    # 30% sorted (100) and 70% shuffled (~25 on average) → a middling score
    assert 35 < sft_gold < 60
    assert all(sorted(parse_prompt(r["prompt"])) == sorted(map(int, r["response"].split())) for r in a.sft)


def test_preferences_follow_gold_up_to_label_noise():
    data = generate_task_data(
        1, n_sft=1, n_pref=500, n_ppo=1, n_val=1, cfg=SortingTaskConfig(label_noise=0.1)
    )
    agree = [
        gold_score(r["prompt"], r["chosen"]) >= gold_score(r["prompt"], r["rejected"])
        for r in data.preferences
    ]
    assert 0.8 < sum(agree) / len(agree) < 0.97
