import pytest

from openaligner.algorithms.schedules import lr_factor


def test_worked_example_warmup_then_cosine():
    f = [lr_factor(s, warmup_steps=1, total_steps=3, schedule="cosine", min_ratio=0.0) for s in range(5)]
    # warm-up 1/2; then cos over steps 1..3: 1, 0.5, 0; held at the floor after
    assert f == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0])


def test_linear_constant_and_floor():
    lin = [lr_factor(s, warmup_steps=0, total_steps=4, schedule="linear", min_ratio=0.2) for s in range(5)]
    assert lin == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert lr_factor(99, warmup_steps=0, total_steps=4, schedule="constant", min_ratio=0.2) == 1.0
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(9, warmup_steps=0, total_steps=4, schedule="step", min_ratio=0.0)
