"""The optimizer step both trainers share: clip, skip on inf/NaN, scheduler, loss scaler."""

import math

import pytest
import torch

from openaligner.trainer.optim_step import optimizer_step


def setup(grad):
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = None if grad is None else torch.tensor(grad)
    optimizer = torch.optim.SGD([p], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    return p, optimizer, scheduler


def step(p, optimizer, scheduler, scaler=None, max_grad_norm=0.0):
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    outcome = optimizer_step([p], optimizer, scheduler, scaler, max_grad_norm=max_grad_norm, gradients="mean")
    assert outcome.stepped == math.isfinite(outcome.grad_norm)
    return outcome


def test_clips_then_steps_optimizer_and_scheduler():
    p, optimizer, scheduler = setup([3.0, 4.0])
    outcome = step(p, optimizer, scheduler, max_grad_norm=1.0)
    assert outcome.grad_norm == pytest.approx(5.0) and outcome.loss_scale == 1.0  # the norm before clipping
    assert p.tolist() == pytest.approx([-0.6, -0.8])  # lr 1 times the clipped gradient
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_a_non_finite_norm_skips_the_step_and_the_schedule():
    p, optimizer, scheduler = setup([math.nan, 1.0])
    assert math.isnan(step(p, optimizer, scheduler).grad_norm)
    assert p.tolist() == [0.0, 0.0] and optimizer.param_groups[0]["lr"] == 1.0


def test_fp16_overflow_lowers_the_loss_scale_and_skips():
    p, optimizer, scheduler = setup([math.inf, 1.0])
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # as the backward's loss was
    outcome = step(p, optimizer, scheduler, scaler)
    assert math.isinf(outcome.grad_norm) and not outcome.stepped
    assert outcome.loss_scale == 4.0  # the scale the gradients carried, before the scaler lowered it
    assert scaler.get_scale() == 2.0 and p.tolist() == [0.0, 0.0]


def test_without_any_gradient_it_steps_nothing_and_leaves_the_scaler_alone():
    p, optimizer, scheduler = setup(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert step(p, optimizer, scheduler, scaler).grad_norm == 0.0
    assert p.tolist() == [0.0, 0.0] and scaler.get_scale() == 4.0
    assert optimizer.param_groups[0]["lr"] == 0.5  # the schedule counts the (empty) step


def test_scale_applies_to_the_synced_gradients_before_the_norm_and_the_clip():
    p, optimizer, scheduler = setup([30.0, 40.0])  # gradients of a loss sum over 10 units
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    outcome = optimizer_step(
        [p], optimizer, scheduler, scaler, max_grad_norm=1.0, gradients="sum", scale=1 / 10
    )
    assert outcome.grad_norm == pytest.approx(5.0)  # the norm of the per-unit mean's gradient
    assert p.tolist() == pytest.approx([-0.6, -0.8])
