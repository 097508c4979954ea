"""The shared optimizer config and builder (train-sft, train-rm, train-ppo, serve-critic)."""

from __future__ import annotations

import pytest
import torch

from openaligner.config import ConfigError, load_config
from openaligner.trainer.optim import OptimConfig, build_optimizer


def lrs(cfg: OptimConfig, run_steps: int | None, steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer, scheduler = build_optimizer([p], cfg, run_steps)
    out = []
    for _ in range(steps):
        out.append(round(scheduler.get_last_lr()[0], 3))
        p.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    return out


def test_cosine_warmup_then_decay_to_min_lr_at_the_run_length():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=3, scheduler="cosine")
    got = lrs(cfg, run_steps=13, steps=15)
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    assert got[8] == 0.55 and got[13:] == [0.1, 0.1]


def test_decay_steps_overrides_the_run_length():
    cfg = OptimConfig(lr=1.0, min_lr=0.2, scheduler="linear", decay_steps=4)
    assert lrs(cfg, run_steps=100, steps=6) == [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        # the rate would never reach optim.lr: at most 10/11 of it
        (OptimConfig(lr=1.0, warmup_steps=10), r"optim\.warmup_steps=10 is not shorter than the run's 10"),
        (OptimConfig(lr=1.0, warmup_steps=20, scheduler="cosine"), r"optim\.warmup_steps < 10 \(e\.g\. 1\)"),
        # the last 6 steps would train at learning rate 0
        (
            OptimConfig(lr=1.0, scheduler="linear", decay_steps=4),
            r"the last 6 would train at learning rate 0",
        ),
    ],
)
def test_a_schedule_that_trains_part_of_the_run_at_less_than_asked_is_refused(cfg, needle):
    with pytest.raises(ConfigError, match=needle):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg, run_steps=10)


def test_schedules_that_fit_the_run_are_built():
    assert lrs(OptimConfig(lr=1.0, warmup_steps=9), run_steps=10, steps=10)[-1] == 1.0
    assert lrs(OptimConfig(lr=1.0, scheduler="linear", decay_steps=10), run_steps=10, steps=10)[-1] == 0.1
    assert lrs(OptimConfig(lr=1.0, min_lr=0.5, scheduler="linear", decay_steps=2), 10, 10)[-1] == 0.5


def test_a_decay_without_a_length_is_refused_and_constant_needs_none():
    with pytest.raises(ValueError, match="decay_steps"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(scheduler="cosine"), None)
    assert lrs(OptimConfig(lr=0.5), run_steps=None, steps=3) == [0.5, 0.5, 0.5]


def test_only_trainable_parameters_are_optimized():
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    trained = torch.nn.Parameter(torch.zeros(1))
    optimizer, _ = build_optimizer([frozen, trained], OptimConfig(), None)
    assert optimizer.param_groups[0]["params"] == [trained]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.lr=0", r"optim\.lr must be > 0"),
        ("optim.min_lr=1", r"optim\.min_lr"),
        ("optim.scheduler=step", r"optim\.scheduler must be one of"),
        ("optim.betas=[0.9]", r"optim\.betas needs two values"),
        ("optim.decay_steps=0", r"optim\.decay_steps must be >= 1"),
        # AdamW's own checks would raise only once the model is built, with a traceback
        ("optim.weight_decay=-0.1", r"optim\.weight_decay must be >= 0"),
        ("optim.betas=[0.9,1.0]", r"optim\.betas must each lie in \[0, 1\)"),
        ("optim.eps=0", r"optim\.eps must be > 0"),
        (
            "optim.scheduler=cosine optim.warmup_steps=10 optim.decay_steps=10",
            r"optim\.warmup_steps=10 must be <",
        ),
    ],
)
def test_bad_values_name_the_commands_key(override, needle):
    from openaligner.trainer.sft import SFTConfig

    with pytest.raises(ConfigError, match=needle):
        load_config(SFTConfig, None, ["data.train_path=x.jsonl", *override.split()])


@pytest.mark.parametrize(
    ("command", "old", "new"),
    [
        ("train-sft", "optim.max_grad_norm=0.5", "trainer.gradient_clip_val"),
        ("train-rm", "optim.max_grad_norm=0.5", "trainer.gradient_clip_val"),
        ("serve-critic", "optim.max_steps=100", "optim.decay_steps"),
    ],
)
def test_the_optimizer_keys_that_moved_are_refused_with_their_new_names(command, old, new):
    from openaligner.cli.main import command as command_of

    schema = command_of(command).SCHEMA
    with pytest.raises(ConfigError, match=rf"{old.split('=')[0]} is now {new}"):
        load_config(
            schema, None, ["data.train_path=x.jsonl" if command != "serve-critic" else "model.tiny=gpt2", old]
        )
