"""The Tinker losses: worked examples, properties (gradients, clip ranges, sums over datums),
the registry's refusals and the input / config checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openaligner.algorithms.tinker_losses import (
    LOSS_METRIC,
    METRIC_REDUCTIONS,
    TINKER_LOSSES,
    TinkerLossInputError,
    batch_loss,
    check_metric_key,
    cispo,
    cross_entropy,
    dro,
    importance_sampling,
    ppo,
    tinker_loss,
)

F64 = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def rl_inputs(q: torch.Tensor, a: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"target_tokens": torch.arange(len(q)), "logprobs": q, "advantages": a}


# -- worked examples (the arithmetic is in each function's docstring) ----------------------------


def test_cross_entropy_worked_example():
    loss, elementwise = cross_entropy(t(-0.5, -1.0, -2.0), {"weights": t(0, 1, 1)}, {})
    assert elementwise.tolist() == [0.0, 1.0, 2.0]
    assert loss.item() == 3.0


def test_importance_sampling_worked_example():
    loss, elementwise = importance_sampling(t(-1, -0.5, -2), rl_inputs(t(-1, -1, -2), t(0, 2, -1)), {})
    assert elementwise.tolist() == pytest.approx([0.0, -2 * math.exp(0.5), 1.0])
    assert loss.item() == pytest.approx(-2 * math.exp(0.5) + 1)  # −2.2974


def test_ppo_worked_example():
    q = torch.zeros(3, dtype=F64)
    lp = torch.log(t(1.0, 1.5, 0.5))  # ratios 1, 1.5, 0.5
    loss, elementwise = ppo(lp, rl_inputs(q, t(1, 1, -1)), {})
    assert elementwise.tolist() == pytest.approx([-1.0, -1.2, 0.8])
    assert loss.item() == pytest.approx(-1.4)


def test_cispo_worked_example():
    lp = t(-1, -0.5, -2)
    q = lp - torch.log(t(1.0, 5.0, 0.5))  # ratios 1, 5, 0.5
    loss, elementwise = cispo(lp, rl_inputs(q, t(1, 1, -1)), {})
    assert elementwise.tolist() == pytest.approx([1.0, 2.0, -1.0])
    assert loss.item() == pytest.approx(2.0)


def test_dro_worked_example():
    loss, elementwise = dro(t(-1, -0.5), rl_inputs(t(-1, -1.5), t(2, -1)), {"beta": 0.1})
    assert elementwise.tolist() == pytest.approx([2.0, -0.45])
    assert loss.item() == pytest.approx(1.55)


def test_cross_entropy_topk_form_sums_over_positions_and_candidates():
    # [N=2, K=2]: −Σ_t Σ_k lp[t,k]·w[t,k] = −(−1·0.75 + −2·0.25 + −0.5·1 + −3·0) = 1.75
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64)
    w = torch.tensor([[0.75, 0.25], [1.0, 0.0]], dtype=F64)
    loss, elementwise = cross_entropy(lp, {"weights": w}, {})
    assert elementwise.shape == (2, 2)
    assert loss.item() == pytest.approx(1.75)


# -- properties -----------------------------------------------------------------------------------


def random_case(seed: int, n: int = 7, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = -torch.rand(n, generator=g, dtype=F64) * 3
    lp = (q + (torch.rand(n, generator=g, dtype=F64) * 2 - 1) * spread).requires_grad_()
    a = torch.randn(n, generator=g, dtype=F64)
    return lp, q, a


@pytest.mark.parametrize("name", sorted(TINKER_LOSSES))
def test_loss_is_the_sum_of_elementwise_and_keeps_the_shape(name):
    lp, q, a = random_case(1)
    inputs = {**rl_inputs(q, a), "weights": torch.rand(7, dtype=F64)}
    if name == "cross_entropy":
        inputs = {"target_tokens": inputs["target_tokens"], "weights": inputs["weights"]}
    loss, elementwise = TINKER_LOSSES[name](
        lp, inputs, TINKER_LOSSES[name].resolve_config({"beta": 0.3} if name == "dro" else None)
    )
    assert loss.dim() == 0 and elementwise.shape == lp.shape
    assert torch.allclose(loss, elementwise.sum())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_importance_sampling_gradient_is_minus_advantage_times_ratio(seed):
    lp, q, a = random_case(seed)
    loss, _ = importance_sampling(lp, rl_inputs(q, a), {})
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, -a * torch.exp(lp.detach() - q))


def test_cross_entropy_gradient_is_minus_weights():
    lp, _, _ = random_case(2)
    w = torch.randn(7, dtype=F64)  # any float: forward_backward_custom sends −dC/dlp
    loss, _ = cross_entropy(lp, {"weights": w}, {})
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.equal(grad, -w)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 0.5), st.floats(0.05, 0.5))
def test_ppo_inside_the_clip_range_equals_importance_sampling(seed, eps_low, eps_high):
    g = torch.Generator().manual_seed(seed)
    q = -torch.rand(6, generator=g, dtype=F64)
    # log-ratios strictly inside (log(1 − ε_low), log(1 + ε_high))
    u = torch.rand(6, generator=g, dtype=F64) * 0.9 + 0.05
    log_ratio = math.log(1 - eps_low) + u * (math.log(1 + eps_high) - math.log(1 - eps_low))
    lp = (q + log_ratio).requires_grad_()
    a = torch.randn(6, generator=g, dtype=F64)
    config = {"clip_low_threshold": 1 - eps_low, "clip_high_threshold": 1 + eps_high}
    ppo_loss, ppo_el = ppo(lp, rl_inputs(q, a), config)
    is_loss, is_el = importance_sampling(lp, rl_inputs(q, a), {})
    assert torch.allclose(ppo_el, is_el)
    (g_ppo,) = torch.autograd.grad(ppo_loss, lp)
    (g_is,) = torch.autograd.grad(is_loss, lp)
    assert torch.allclose(g_ppo, g_is)


def test_ppo_outside_the_clip_range_stops_the_gradient_on_the_pushed_side_only():
    q = torch.zeros(4, dtype=F64)
    # ratio 1.5 with A > 0 (clipped: no gradient), 1.5 with A < 0 (unclipped side: gradient),
    # 0.5 with A < 0 (clipped), 0.5 with A > 0 (gradient)
    lp = torch.log(t(1.5, 1.5, 0.5, 0.5)).requires_grad_()
    a = t(1, -1, -1, 1)
    loss, el = ppo(lp, rl_inputs(q, a), {})
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.tolist() == pytest.approx([0.0, 1.5, 0.0, -0.5])
    assert el.tolist() == pytest.approx([-1.2, 1.5, 0.8, -0.5])


def test_ppo_takes_its_clip_thresholds_from_the_config():
    q = torch.zeros(1, dtype=F64)
    lp = torch.log(t(1.5))
    # default high 1.2 clips: −1.2; a high bound of 2 does not: −1.5
    assert ppo(lp, rl_inputs(q, t(1)), {})[0].item() == pytest.approx(-1.2)
    assert ppo(lp, rl_inputs(q, t(1)), {"clip_high_threshold": 2.0})[0].item() == pytest.approx(-1.5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.9), st.floats(1.0, 5.0))
def test_cispo_gradient_flows_only_through_the_log_likelihood(seed, low, high):
    lp, q, a = random_case(seed, spread=2.0)
    loss, _ = cispo(lp, rl_inputs(q, a), {"clip_low_threshold": low, "clip_high_threshold": high})
    (grad,) = torch.autograd.grad(loss, lp)
    coefficient = torch.exp(lp.detach() - q).clamp(low, high)
    # d/dlp of −c·lp·A with c held constant; a gradient through the ratio would add −c·lp·A
    # wherever the ratio is inside [low, high]
    assert torch.allclose(grad, -coefficient * a)


def test_cispo_never_zeroes_a_tokens_gradient_where_ppo_would():
    q = torch.zeros(1, dtype=F64)
    lp = torch.log(t(10.0)).requires_grad_()  # far above both upper bounds, A > 0
    (g_cispo,) = torch.autograd.grad(cispo(lp, rl_inputs(q, t(1)), {})[0], lp)
    (g_ppo,) = torch.autograd.grad(ppo(lp, rl_inputs(q, t(1)), {})[0], lp)
    assert g_ppo.item() == 0.0
    assert g_cispo.item() == pytest.approx(-4.0)  # the coefficient capped at 4


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 2.0))
def test_dro_at_lp_equal_q_is_minus_lp_times_advantage(seed, beta):
    lp, _, a = random_case(seed)
    q = lp.detach().clone()
    loss, _ = dro(lp, rl_inputs(q, a), {"beta": beta})
    assert torch.allclose(loss, -(lp * a).sum())
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, -a)


def test_dro_penalty_grows_with_beta_and_the_log_ratio():
    lp, q, a = t(-1.0), t(-2.0), t(0.0)
    losses = [dro(lp, rl_inputs(q, a), {"beta": b})[0].item() for b in (0.0, 0.5, 1.0)]
    assert losses == pytest.approx([0.0, 0.25, 0.5])  # ½·β·(1)²


@pytest.mark.parametrize("name", sorted(TINKER_LOSSES))
def test_sums_add_across_datums_and_split_calls_accumulate_the_same_gradient(name):
    """One call over four datums, or two calls over two each (gradients accumulated, as across
    forward_backward calls before one optim_step), give the same loss and gradient: a sum, no
    mean anywhere."""
    loss_fn = TINKER_LOSSES[name]
    config = loss_fn.resolve_config({"beta": 0.2} if name == "dro" else None)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 11, generator=g, dtype=F64)  # 4 datums, 5 positions, vocab 11
    targets = torch.randint(0, 11, (4, 5), generator=g)
    q = -torch.rand(4, 5, generator=g, dtype=F64) * 2
    a = torch.randn(4, 5, generator=g, dtype=F64)
    w = torch.rand(4, 5, generator=g, dtype=F64)

    def datum_inputs(i):
        if name == "cross_entropy":
            return {"target_tokens": targets[i], "weights": w[i]}
        return {"target_tokens": targets[i], "logprobs": q[i], "advantages": a[i]}

    def run(param, datums):
        lps = [torch.log_softmax(param[i], -1).gather(-1, targets[i, :, None])[:, 0] for i in datums]
        return batch_loss(loss_fn, lps, [datum_inputs(i) for i in datums], config)

    whole = logits.clone().requires_grad_()
    total, elementwise = run(whole, range(4))
    total.backward()
    assert len(elementwise) == 4
    assert torch.allclose(total, sum(e.sum() for e in elementwise))

    split = logits.clone().requires_grad_()
    first, _ = run(split, [0, 1])
    first.backward()
    second, _ = run(split, [2, 3])
    second.backward()
    assert torch.allclose(first + second, total)
    assert torch.allclose(split.grad, whole.grad)


def test_batch_loss_of_no_datums_is_zero():
    total, elementwise = batch_loss(tinker_loss("cross_entropy"), [], [], {})
    assert total.item() == 0.0 and elementwise == []


# -- the registry ---------------------------------------------------------------------------------


def test_registry_holds_exactly_the_supported_losses():
    assert set(TINKER_LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}
    assert tinker_loss("ppo").fn is ppo


@pytest.mark.parametrize("name", ["stable_reinforce", "gspo", "custom"])
def test_tinker_losses_we_do_not_implement_are_refused_with_the_reason_and_the_supported_ones(name):
    with pytest.raises(
        ValueError, match=rf"'{name}' is not supported by this server: .*Supported: cross_entropy, "
    ):
        tinker_loss(name)


def test_an_unknown_loss_name_is_refused_naming_the_supported_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown loss_fn 'mse'; supported: cross_entropy, importance_sampling, ppo, cispo, dro",
    ):
        tinker_loss("mse")


# -- the config and input checks -------------------------------------------------------------------


def test_config_defaults_are_tinkers():
    assert tinker_loss("ppo").resolve_config(None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert tinker_loss("cispo").resolve_config({}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert tinker_loss("importance_sampling").resolve_config(None) == {}


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "ppo",
            {"clip_eps": 0.2},
            r"unknown key\(s\) \['clip_eps'\]; it takes clip_high_threshold, clip_low_threshold",
        ),
        ("importance_sampling", {"beta": 1.0}, r"unknown key\(s\) \['beta'\]; it takes no keys"),
        ("ppo", {"clip_low_threshold": "0.8"}, r"must be a finite number, got '0.8'"),
        ("ppo", {"clip_low_threshold": math.nan}, r"must be a finite number"),
        (
            "ppo",
            {"clip_low_threshold": 1.3},
            r"0 <= clip_low_threshold <= clip_high_threshold, got 1.3 and 1.2",
        ),
        ("cispo", {"clip_low_threshold": -0.1}, r"got -0.1 and 4.0"),
        ("dro", {}, r"dro needs loss_fn_config\['beta'\]"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(name, config, message):
    with pytest.raises(TinkerLossInputError, match=message):
        tinker_loss(name).resolve_config(config)


def test_dro_called_without_beta_refuses():
    with pytest.raises(TinkerLossInputError, match="beta"):
        dro(t(-1.0), rl_inputs(t(-1.0), t(1.0)), {})


def good_rl(n: int = 3) -> dict[str, torch.Tensor]:
    return {
        "target_tokens": torch.arange(n),
        "logprobs": -torch.ones(n),
        "advantages": torch.ones(n),
    }


def test_good_inputs_pass_the_check():
    tinker_loss("importance_sampling").check_inputs(good_rl(), 3, vocab_size=10)
    tinker_loss("cross_entropy").check_inputs(
        {"target_tokens": torch.zeros(3, 2, dtype=torch.long), "weights": torch.ones(3, 2)}, 3
    )


@pytest.mark.parametrize(
    ("name", "inputs", "message"),
    [
        (
            "importance_sampling",
            {"target_tokens": torch.arange(3), "logprobs": -torch.ones(3)},
            r"datum 4: loss_fn_inputs for importance_sampling: missing \['advantages'\]; "
            r"it takes target_tokens, logprobs, advantages \(optionally weights\)",
        ),
        ("importance_sampling", {**good_rl(), "mask": torch.ones(3)}, r"unexpected \['mask'\]"),
        ("cross_entropy", {"target_tokens": torch.arange(3)}, r"missing \['weights'\]"),
        ("dro", {**good_rl(), "weights": torch.ones(3)}, r"unexpected \['weights'\]"),
        (
            "ppo",
            {**good_rl(), "target_tokens": torch.arange(4)},
            r"target_tokens has shape \[4\], expected \[3\]",
        ),
        (
            "ppo",
            {**good_rl(), "target_tokens": torch.zeros(3, 2, dtype=torch.long)},
            r"target_tokens has shape \[3, 2\], expected \[3\] ",
        ),
        (
            "cross_entropy",
            {"target_tokens": torch.zeros(3, 2, dtype=torch.long), "weights": torch.ones(3)},
            r"weights has shape \[3\], expected \[3, 2\]",
        ),
        ("ppo", {**good_rl(), "advantages": torch.ones(2)}, r"advantages has shape \[2\], expected \[3\]"),
        ("ppo", {**good_rl(), "target_tokens": torch.ones(3)}, r"target_tokens must be integer token ids"),
        ("ppo", {**good_rl(), "logprobs": torch.zeros(3, dtype=torch.long)}, r"logprobs must be float32"),
        (
            "ppo",
            {**good_rl(), "advantages": torch.tensor([1.0, math.inf, 0.0])},
            r"advantages\[1\] = inf is not finite",
        ),
        (
            "ppo",
            {**good_rl(), "target_tokens": torch.tensor([0, 10, 1])},
            r"target_tokens\[1\] = 10 is not a token id of this model \(expected 0 <= id < 10\)",
        ),
        ("ppo", {**good_rl(), "target_tokens": torch.tensor([0, -1, 1])}, r"target_tokens\[1\] = -1"),
        (
            "importance_sampling",
            {**good_rl(), "weights": torch.tensor([0.0, 1.0, 1.0])},
            r"weights must be 1, or 0 where advantages are 0",
        ),
        (
            "importance_sampling",
            {**good_rl(), "weights": torch.tensor([0.5, 1.0, 1.0])},
            r"weights must be 1",
        ),
    ],
)
def test_bad_inputs_are_refused_naming_the_datum_the_key_and_what_was_expected(name, inputs, message):
    with pytest.raises(TinkerLossInputError, match=message):
        tinker_loss(name).check_inputs(inputs, 3, vocab_size=10, datum=4)


def test_rl_weights_that_only_mask_zero_advantage_tokens_are_accepted_and_change_nothing():
    inputs = {
        **good_rl(),
        "advantages": torch.tensor([0.0, 1.0, -1.0]),
        "weights": torch.tensor([0.0, 1.0, 1.0]),
    }
    tinker_loss("importance_sampling").check_inputs(inputs, 3)
    lp = -torch.ones(3)
    with_w, _ = importance_sampling(lp, inputs, {})
    without, _ = importance_sampling(lp, {k: v for k, v in inputs.items() if k != "weights"}, {})
    assert torch.equal(with_w, without)


# -- metrics ----------------------------------------------------------------------------------------


def test_metric_keys():
    assert check_metric_key(LOSS_METRIC) == "loss:sum"
    for reduction in METRIC_REDUCTIONS:
        check_metric_key(f"x:{reduction}")
    for bad in ("loss", "loss:", ":sum", "loss:average", "a:b:sum"):
        with pytest.raises(ValueError, match="name:reduction"):
            check_metric_key(bad)
