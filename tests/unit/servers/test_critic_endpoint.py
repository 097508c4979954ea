"""Critic endpoints and CriticServerTrainer (with its CriticTrainer) on in-memory arrays (no Triton
process)."""

import copy
import json
from functools import partial

import numpy as np
import pytest
import torch

from openaligner.algorithms import value_loss
from openaligner.io.checkpoint import CheckpointManager, verify_checkpoint
from openaligner.protocol import TOKEN_ENV, TOKEN_PARAMETER
from openaligner.servers.critic import CriticInferEndpoint, CriticServerConfig, CriticServerTrainer
from openaligner.servers.validation import RequestError, UnauthorizedError
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer


def make_trainer(
    tiny,
    tmp_path=None,
    *,
    combined=True,
    gbs=4,
    mbs=2,
    lr=1e-2,
    clip=0.2,
    sgd=False,
    arch="gpt2",
    resume_step=None,
    **cfg,
):
    critic = tiny.critic(arch)
    if sgd:  # plain SGD keeps gradient round-off visible at its own size (Adam's first step is ~sign(g))
        optimizer: torch.optim.Optimizer = torch.optim.SGD(critic.parameters(), lr=lr)
    else:
        optimizer = torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=0.0)
    checkpoints = CheckpointManager(tmp_path) if tmp_path is not None else None
    train_cfg = CriticTrainConfig(global_batch_size=gbs, micro_batch_size=mbs, loss_clip_val=clip)
    return CriticServerTrainer(
        CriticServerConfig(combine_rm_and_critic_server=combined, model_forward_micro_batch_size=2, **cfg),
        CriticTrainer(train_cfg, critic, optimizer, checkpoints=checkpoints),
        None,
        reward_model=tiny.reward_model() if combined else None,
        resume_step=resume_step,
    )


def batch(seed=0, rows=6, width=12, vocab=100):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (rows, width), generator=g)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = (torch.arange(width - 1)[None, :] < (lengths - 1)[:, None]).float()
    return tokens, lengths, mask


def infer(trainer, tokens, lengths):
    return trainer.run_inference(tokens=tokens.numpy(), sequence_lengths=lengths.numpy().reshape(-1, 1))


def train_inputs(tokens, returns, prev_values, mask):
    return dict(
        tokens=np.asarray(tokens, np.int64),
        returns=np.asarray(returns, np.float32),
        prev_values=np.asarray(prev_values, np.float32),
        mask=np.asarray(mask, np.float32),
    )


def weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- infer
def test_infer_outputs_match_the_models_combined_and_separate(tiny):
    tokens, lengths, _ = batch(rows=5)
    combined = make_trainer(tiny)
    out = infer(combined, tokens, lengths)
    assert set(out) == {"values", "rewards"}
    assert out["values"].shape == (5, 12) and out["values"].dtype == np.float32
    assert out["rewards"].shape == (5, 1)
    torch.testing.assert_close(torch.from_numpy(out["values"]), tiny.critic().infer(tokens, lengths))
    torch.testing.assert_close(
        torch.from_numpy(out["rewards"]).reshape(-1), tiny.reward_model().infer(tokens, lengths)
    )
    separate = make_trainer(tiny, combined=False)
    out = infer(separate, tokens, lengths)
    assert set(out) == {"values"}  # no placeholder rewards: Triton needs equal batch sizes
    assert [s.name for s in separate.infer_endpoint.outputs] == ["values"]


def test_infer_endpoint_strips_pads_and_restores_each_request_width():
    seen = []

    def forward(tokens, lengths):
        seen.append(tuple(tokens.shape))
        values = tokens.float() * (torch.arange(tokens.shape[1]) < lengths[:, None])
        return values, lengths.float()

    ep = CriticInferEndpoint(
        forward,
        combined=True,
        vocab_size=100,
        strip_sequence_length_to_multiple=4,
        dp_size=2,
        forward_micro_batch_size=2,
    )
    reqs = [
        ep.validate({"tokens": np.array([[5, 6, 7, 0, 0, 0, 0, 0]]), "sequence_lengths": np.array([[3]])}),
        ep.validate(
            {"tokens": np.array([[8, 9, 0, 0, 0, 0, 0, 0]] * 2), "sequence_lengths": np.array([[2], [1]])}
        ),
    ]
    out = ep.run(reqs)
    assert seen == [(4, 4)]  # 3 rows padded to a multiple of 2 ranks, columns stripped to 4
    assert out[0]["values"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0]]
    assert out[1]["values"].tolist() == [[8, 9, 0, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]
    assert out[1]["rewards"].tolist() == [[2.0], [1.0]]
    assert ep.stats.padded_rows == 1


def test_infer_standardizes_rewards_and_values(tiny):
    tokens, lengths, _ = batch(rows=3)
    plain = infer(make_trainer(tiny), tokens, lengths)
    t = make_trainer(tiny)
    t.model.standardization = (1.0, 2.0)
    assert t.reward_model is not None
    t.reward_model.standardization = (1.0, 2.0)
    scaled = infer(t, tokens, lengths)
    np.testing.assert_allclose(scaled["rewards"], (plain["rewards"] - 1.0) / 2.0, atol=1e-6)
    valid = np.arange(12)[None, :] < lengths.numpy()[:, None]
    np.testing.assert_allclose(scaled["values"][valid], (plain["values"][valid] - 1.0) / 2.0, atol=1e-6)


# ---------------------------------------------------------------------------- train validation
TOK = np.full((2, 5), 7, np.int64)
GOOD = train_inputs(TOK, np.zeros((2, 4)), np.zeros((2, 4)), np.ones((2, 4)))


def with_(**changes):
    return {**GOOD, **changes}


def without(name):
    return {k: v for k, v in GOOD.items() if k != name}


def with_value(name, row, col, value):
    array = GOOD[name].copy()
    array[row, col] = value
    return with_(**{name: array})


BAD_TRAIN = {
    "returns S wide": (
        with_(returns=np.zeros((2, 5), np.float32)),
        "'returns' has width 5 but 'tokens' has width 5",
    ),
    "mask S-2 wide": (with_(mask=np.ones((2, 3), np.float32)), "must be 4 wide (S-1)"),
    "rows differ": (
        with_(prev_values=np.zeros((3, 4), np.float32)),
        "'prev_values' has 3 rows but 'tokens' has 2",
    ),
    "NaN return": (with_value("returns", 1, 2, np.nan), "input 'returns': row 1, position 2 is nan"),
    "inf prev value": (
        with_value("prev_values", 0, 0, np.inf),
        "input 'prev_values': row 0, position 0 is inf",
    ),
    "NaN mask": (with_value("mask", 0, 3, np.nan), "input 'mask': row 0, position 3 is nan"),
    "mask not 0/1": (with_value("mask", 0, 1, 0.5), "a mask holds only 0 (ignored) and 1 (trained)"),
    "all-zero mask": (with_(mask=np.zeros((2, 4), np.float32)), "is all zeros"),
    "missing mask": (without("mask"), "input 'mask' (float32 [N, S-1]"),
    "tokens int32": (with_(tokens=TOK.astype(np.int32)), "input 'tokens': expected int64 [N, S], got int32"),
    "returns 1-D": (with_(returns=np.zeros(8, np.float32)), "expected float32 [N, S-1], got float32 [8]"),
    "unknown input": (with_(advantages=np.zeros((2, 4), np.float32)), "unexpected input(s) ['advantages']"),
    "id outside vocabulary": (with_value("tokens", 1, 4, 100), "row 1, position 4 holds id 100, outside"),
    "width 1": (
        train_inputs(np.ones((2, 1)), np.zeros((2, 0)), np.zeros((2, 0)), np.ones((2, 0))),
        "at least 2 tokens per row",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TRAIN))
def test_bad_train_requests_are_refused_and_leave_the_weights_alone(tiny, case):
    trainer = make_trainer(tiny, combined=False)
    before = weights(trainer)
    inputs, needle = BAD_TRAIN[case]
    with pytest.raises(RequestError) as info:
        trainer.run_training(**inputs)
    assert needle in str(info.value)
    assert same_weights(before, weights(trainer)) and trainer.step == 0
    trainer.run_training(**GOOD)  # still usable
    assert trainer.step == 1


def test_row_and_width_limits(tiny):
    trainer = make_trainer(tiny, combined=False, max_train_rows=1, max_sequence_length=4)
    with pytest.raises(RequestError, match="at most 1 per request"):
        trainer.run_training(**GOOD)
    one = {k: v[:1] for k, v in GOOD.items()}
    with pytest.raises(RequestError, match="5 wide, more than the server's max_sequence_length 4"):
        trainer.run_training(**one)


def test_max_sequence_length_defaults_to_the_models_position_limit(tiny):
    trainer = make_trainer(tiny)  # no max_sequence_length in the config
    limit = tiny.size.max_positions
    assert trainer.max_sequence_length == limit
    too_long = torch.full((1, limit + 1), 5)
    with pytest.raises(RequestError, match=f"max_sequence_length {limit}"):
        infer(trainer, too_long, torch.tensor([limit + 1]))
    with pytest.raises(RequestError, match=f"{limit + 1} wide, more than the server's max_sequence_length"):
        trainer.run_training(
            tokens=too_long.numpy(),
            returns=np.zeros((1, limit), np.float32),
            prev_values=np.zeros((1, limit), np.float32),
            mask=np.ones((1, limit), np.float32),
        )
    assert make_trainer(tiny, max_sequence_length=8).max_sequence_length == 8


# ---------------------------------------------------------------------------- training
def test_training_moves_values_toward_the_returns(tiny):
    trainer = make_trainer(tiny, combined=False, lr=3e-3)
    tokens, lengths, mask = batch(rows=8)
    values = torch.from_numpy(infer(trainer, tokens, lengths)["values"])[:, :-1]
    returns = torch.full_like(values, 0.7)

    def error(v):
        return float(((v - returns).abs() * mask).sum() / mask.sum())

    start = error(values)
    for _ in range(3):
        out = trainer.run_training(**train_inputs(tokens, returns, values, mask))
    after = torch.from_numpy(infer(trainer, tokens, lengths)["values"])[:, :-1]
    assert error(after) < 0.5 * start
    assert trainer.step == 3 * 2  # 8 rows / gbs 4 per request
    assert out["step"].tolist() == [6] and out["loss_mean"].shape == (1,)
    assert out["optimizer_steps"].tolist() == [2]  # this request's: the trainer checks step − these
    assert 0.0 <= float(out["clip_fraction"][0]) <= 1.0


def test_first_step_equals_a_full_batch_token_mean_reference(tiny):
    """Micro-batching and padding rows change nothing: the step is that of one token-mean loss."""
    tokens, _lengths, mask = batch(rows=3, width=10)
    prev = torch.randn(3, 9, generator=torch.Generator().manual_seed(1)) * 0.1
    returns = torch.randn(3, 9, generator=torch.Generator().manual_seed(2))
    results = []
    for mbs in (1, 2, 4):
        trainer = make_trainer(tiny, combined=False, gbs=4, mbs=mbs, lr=0.5, sgd=True)
        out = trainer.run_training(**train_inputs(tokens, returns, prev, mask))
        results.append((float(out["loss_mean"][0]), weights(trainer)))
    reference = tiny.critic()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss, _ = value_loss(reference(tokens)[:, :-1], prev, returns, mask, 0.2)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    ref_opt.step()
    for got_loss, got in results:
        assert got_loss == pytest.approx(loss.item(), rel=1e-5)
        assert not same_weights(got, tiny.critic().state_dict())
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)


def test_training_never_touches_the_reward_model(tiny):
    trainer = make_trainer(tiny)
    assert trainer.reward_model is not None
    rm_before = {k: v.clone() for k, v in trainer.reward_model.state_dict().items()}
    tokens, _lengths, mask = batch(rows=4)
    trainer.run_training(**train_inputs(tokens, torch.ones(4, 11), torch.zeros(4, 11), mask))
    assert not same_weights(weights(trainer), {k: v for k, v in tiny.critic().state_dict().items()})
    assert same_weights(rm_before, {k: v for k, v in trainer.reward_model.state_dict().items()})
    assert all(not p.requires_grad for p in trainer.reward_model.parameters())


def test_standardization_enters_the_loss(tiny):
    tokens, lengths, mask = batch(rows=4)
    trainer = make_trainer(tiny, combined=False, clip=0.0)
    trainer.model.standardization = (0.5, 4.0)
    values = torch.from_numpy(infer(trainer, tokens, lengths)["values"])[:, :-1]  # standardized
    out = trainer.run_training(**train_inputs(tokens, values, values, mask))
    assert float(out["loss_mean"][0]) == pytest.approx(0.0, abs=1e-10)  # targets equal the served values


# ---------------------------------------------------------------------------- save / resume
def test_save_then_a_new_trainer_resumes_step_weights_and_optimizer(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, combined=True)
    tokens, lengths, mask = batch(rows=4)
    trainer.run_training(**train_inputs(tokens, torch.ones(4, 11), torch.zeros(4, 11), mask))
    assert trainer.save() == 1
    path = tmp_path / "step_1"
    assert verify_checkpoint(path) is None
    assert (path / "critic" / "model.safetensors").is_file() and (path / "critic" / "config.json").is_file()
    assert json.loads((path / "critic_state.json").read_text())["step"] == 1
    again = make_trainer(tiny, tmp_path, combined=True)
    assert again.step == 1 and same_weights(weights(trainer), weights(again))
    assert (
        again.trainer.optimizer.state_dict()["state"][0]["step"]
        == trainer.trainer.optimizer.state_dict()["state"][0]["step"]
    )
    assert again.reward_model is not None
    torch.testing.assert_close(  # the RM is the original, not the trained critic
        again.reward_model.infer(tokens, lengths), tiny.reward_model().infer(tokens, lengths)
    )
    # both continue identically
    for t in (trainer, again):
        t.run_training(**train_inputs(tokens, torch.ones(4, 11), torch.zeros(4, 11), mask))
    assert same_weights(weights(trainer), weights(again))


@pytest.mark.parametrize("arch", ["gpt_neox", "mixtral"])
def test_resume_continues_exactly_for_architectures_with_converted_keys(tiny, tmp_path, arch):
    """Two training requests straight vs. one, save, a new server resumes at construction, one
    more: bitwise equal weights (on CPU the same float operations run in the same order). Mixtral's
    experts are fused in the module but saved one by one."""
    tokens, _lengths, mask = batch(rows=4)
    requests = [train_inputs(tokens, torch.full((4, 11), r), torch.zeros(4, 11), mask) for r in (1.0, -1.0)]
    straight = make_trainer(tiny, combined=False, arch=arch)
    for r in requests:
        straight.run_training(**r)
    first = make_trainer(tiny, tmp_path, combined=False, arch=arch)
    first.run_training(**requests[0])
    first.save()
    resumed = make_trainer(tiny, tmp_path, combined=False, arch=arch)
    assert resumed.step == first.step == 1
    resumed.run_training(**requests[1])
    assert same_weights(weights(resumed), weights(straight))


def test_resume_from_a_sharded_critic_directory(tiny, tmp_path):
    """A critic saved in shards (``model.safetensors.index.json``, as large models are) resumes
    and continues exactly."""
    trainer = make_trainer(tiny, tmp_path, combined=False)
    hf = trainer.model.hf_model
    hf.save_pretrained = partial(type(hf).save_pretrained, hf, max_shard_size="50KB")
    tokens, _lengths, mask = batch(rows=4)
    inputs = train_inputs(tokens, torch.ones(4, 11), torch.zeros(4, 11), mask)
    trainer.run_training(**inputs)
    trainer.save()
    assert (tmp_path / "step_1" / "critic" / "model.safetensors.index.json").is_file()
    again = make_trainer(tiny, tmp_path, combined=False)
    assert again.step == 1 and same_weights(weights(again), weights(trainer))
    for t in (trainer, again):
        t.run_training(**inputs)
    assert same_weights(weights(trainer), weights(again))


def test_crash_while_saving_keeps_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    trainer = make_trainer(tiny, tmp_path, combined=False)
    tokens, _lengths, mask = batch(rows=4)
    inputs = train_inputs(tokens, torch.ones(4, 11), torch.zeros(4, 11), mask)
    trainer.run_training(**inputs)
    trainer.save()
    saved = weights(trainer)
    trainer.run_training(**inputs)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", crash)  # weights are written, then the optimizer fails
    with pytest.raises(Exception, match="disk full"):
        trainer.save()
    monkeypatch.undo()
    assert CheckpointManager(tmp_path).latest() == tmp_path / "step_1"
    assert list(tmp_path.glob(".tmp-step_2-*")), "expected the unfinished save's temporary directory"
    again = make_trainer(tiny, tmp_path, combined=False)
    assert again.step == 1 and same_weights(saved, weights(again))
    trainer.run_training(**inputs)  # the server goes on
    assert trainer.step == 3


def _three_saved_steps(tiny, tmp_path):
    """A server that trained and saved critic steps 1, 2 and 3; returns it, its requests and the
    weights after each step."""
    trainer = make_trainer(tiny, tmp_path, combined=False)
    tokens, _lengths, mask = batch(rows=4)
    requests = [
        train_inputs(tokens, torch.full((4, 11), r), torch.zeros(4, 11), mask) for r in (1.0, -1.0, 2.0)
    ]
    after = []
    for r in requests:
        trainer.run_training(**r)
        trainer.save()
        after.append(weights(trainer))
    return trainer, requests, after


def test_restore_step_goes_back_to_a_held_checkpoint_and_continues_exactly(tiny, tmp_path):
    """A trainer resumed from its checkpoint of critic step 1 tells the server (which went on to
    step 3) to go back there: the server then continues exactly as it did from step 1."""
    trainer, requests, after = _three_saved_steps(tiny, tmp_path)
    answer = trainer.save_endpoint.run(
        [trainer.save_endpoint.validate({"dummy_var": np.zeros(1, np.int64), "restore_step": np.array([1])})]
    )[0]
    assert answer["status"].tolist() == [0] and answer["step"].tolist() == [1]
    assert trainer.step == 1 and same_weights(weights(trainer), after[0])
    assert trainer.trainer.optimizer.state_dict()["state"][0]["step"] == 1
    trainer.run_training(**requests[1])
    assert trainer.step == 2 and same_weights(weights(trainer), after[1])
    assert trainer.restore(2) == 2  # sent twice (a resend after a lost connection): the same state
    assert trainer.restore(2) == 2 and same_weights(weights(trainer), after[1])
    assert CheckpointManager(tmp_path).latest() == tmp_path / "step_3"  # restoring writes nothing


def test_restore_step_not_held_is_refused_naming_the_held_steps_and_changes_nothing(tiny, tmp_path):
    trainer, _, after = _three_saved_steps(tiny, tmp_path)
    with pytest.raises(RequestError) as info:
        trainer.restore(7)
    assert (
        f"input 'restore_step': cannot go back to critic step 7: there is no {tmp_path / 'step_7'}; this "
        f"server holds checkpoints of critic steps [1, 2, 3] under {tmp_path} (checkpoint.keep_last=0 "
        "keeps every one)"
    ) in str(info.value)
    (tmp_path / "step_2" / "critic_state.json").write_text('{"step": 9}')  # damaged on disk
    with pytest.raises(RequestError, match=r"step_2 is not complete \(critic_state.json has"):
        trainer.restore(2)
    with pytest.raises(RequestError, match="steps are >= 0"):
        trainer.restore(-1)
    assert trainer.step == 3 and same_weights(weights(trainer), after[2])


def test_resume_step_starts_the_server_from_the_named_checkpoint(tiny, tmp_path):
    _, _, after = _three_saved_steps(tiny, tmp_path)
    again = make_trainer(tiny, tmp_path, combined=False, resume_step=2)
    assert again.step == 2 and same_weights(weights(again), after[1])
    with pytest.raises(ValueError, match=r"checkpoint.resume_step=5: there is no .*step_5; .* \[1, 2, 3\]"):
        make_trainer(tiny, tmp_path, combined=False, resume_step=5)
    with pytest.raises(ValueError, match="resume_step=1: this server has no checkpoint directory"):
        make_trainer(tiny, combined=False, resume_step=1)


def test_save_without_a_checkpoint_directory_is_refused(tiny):
    trainer = make_trainer(tiny, combined=False)
    with pytest.raises(RequestError, match="no checkpoint directory"):
        trainer.save()


# ---------------------------------------------------------------------------- token
def test_token_from_config_or_environment(tiny, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert make_trainer(tiny, combined=False).token is None
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    trainer = make_trainer(tiny, combined=False)
    assert trainer.token == "from-env"
    trainer._authorize({TOKEN_PARAMETER: "from-env"})
    with pytest.raises(UnauthorizedError, match="needs the server's token"):
        trainer._authorize({})
    with pytest.raises(UnauthorizedError, match="does not match"):
        trainer._authorize({TOKEN_PARAMETER: "guess"})
    assert make_trainer(tiny, combined=False, token="cfg").token == "cfg"


def test_constructor_checks(tiny):
    critic = tiny.critic()
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=4), critic, torch.optim.SGD(critic.parameters(), lr=0.1)
    )
    with pytest.raises(ValueError, match="needs the reward_model"):
        CriticServerTrainer(CriticServerConfig(), trainer, None)
    with pytest.raises(ValueError, match="model_forward_micro_batch_size"):
        CriticServerConfig(model_forward_micro_batch_size=0)
    with pytest.raises(ValueError, match="max_request_bytes"):
        CriticServerConfig(max_request_bytes=0)
    with pytest.raises(ValueError, match="max_train_rows"):
        CriticServerConfig(max_train_rows=0)
    copy.deepcopy(CriticServerConfig())


def test_critic_train_is_refused_once_the_schedule_has_decayed_the_rate_to_zero(tiny):
    """A decay to optim.min_lr=0 that ends before the PPO run does used to train every later pass at
    rate 0: the critic silently stopped learning. Now those passes are refused, naming the keys."""
    from openaligner.trainer.optim import OptimConfig, build_optimizer

    server = make_trainer(tiny, combined=False, gbs=6, mbs=6)
    cfg = OptimConfig(lr=1e-2, min_lr=0.0, scheduler="linear", decay_steps=2)
    server.trainer.optimizer, server.trainer.scheduler = build_optimizer(server.model.parameters(), cfg, None)
    tokens, _, mask = batch()
    inputs = train_inputs(tokens, torch.randn(mask.shape), torch.zeros(mask.shape), mask)
    lrs = []
    for _ in range(2):  # steps 0 and 1 of the decay: rates 1e-2 and 5e-3
        before = weights(server)
        lrs.append(float(server.run_training(**inputs)["lr"][0]))
        assert not same_weights(before, weights(server))
    assert lrs == pytest.approx([1e-2, 5e-3])
    before = weights(server)
    with pytest.raises(RequestError, match=r"decayed to 0.*optim\.decay_steps.*optim\.min_lr > 0"):
        server.run_training(**inputs)
    assert same_weights(before, weights(server)) and server.trainer.step == 2
