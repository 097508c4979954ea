"""The PPO trainer scores rollouts under the distribution it sampled from, stops responses where
SFT taught the policy to stop, and never steps on an inf/NaN gradient.

Each test drives :class:`PPOTrainer` with the actor built as ``train-ppo`` builds it (no sampling
settings of its own: the trainer's config is their one source).
"""

import copy
import logging

import pytest
import torch
from ppo_fakes import SIZE, TargetTokenScorer, make_trainer, ppo_cfg

from openaligner.config import ConfigError
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.trainer.policy_loss import PolicyLoss, PolicyLossConfig
from openaligner.trainer.ppo import NonFiniteTrainingError


class RecordingActor(CausalLMActor):
    """Records each log-prob pass: its inputs, its answer and the scoring model's weights then,
    with the prompt lengths of the rollouts generated before it."""

    calls: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Module]]
    prompt_lengths: list[torch.Tensor]

    def infer(self, *args, **kwargs):
        out = super().infer(*args, **kwargs)
        self.prompt_lengths.append(out["prompt_lengths"].cpu())
        return out

    def get_inference_log_probs(self, tokens, lengths=None, *args):
        out = super().get_inference_log_probs(tokens, lengths, *args)
        prompts = torch.cat(self.prompt_lengths)
        self.calls.append(("policy", tokens, lengths, prompts, out, copy.deepcopy(self.model)))
        return out

    def get_init_policy_logprobs(self, tokens, lengths=None, *args):
        out = super().get_init_policy_logprobs(tokens, lengths, *args)
        prompts = torch.cat(self.prompt_lengths)
        self.calls.append(("init", tokens, lengths, prompts, out, self.init_policy))
        return out


def _recording_actor(seed=0):
    actor = RecordingActor(build_tiny_causal_lm("gpt2", SIZE, seed=seed))
    actor.calls, actor.prompt_lengths = [], []
    return actor


def _reference_logprobs(model, tokens, lengths, temperature, banned=None):
    """log softmax(logits / T) of each next token, straight from the HF forward ([B, S-1])."""
    attention = (torch.arange(tokens.shape[1]) < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=attention).logits.float()[:, :-1]
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _response_mask(prompt_lengths, lengths, width):
    col = torch.arange(width)
    return (col >= prompt_lengths[:, None] - 1) & (col < lengths[:, None] - 1)


def test_rollout_and_init_policy_logprobs_use_the_sampling_temperature(tmp_path):
    actor = _recording_actor()
    overrides = {"sampling.temperature": 0.5, "length.min_length": 0}  # min_length: next test
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0, **overrides)
    make_trainer(tmp_path, cfg, actor=actor).fit()
    kinds = [c[0] for c in actor.calls]
    assert kinds == ["policy", "init"]
    for _, tokens, lengths, prompts, logprobs, model in actor.calls:
        mask = _response_mask(prompts, lengths, tokens.shape[1] - 1)
        expected = _reference_logprobs(model, tokens, lengths, temperature=0.5)
        assert torch.allclose(logprobs[mask], expected[mask], atol=1e-5)
        # and not the T=1 distribution (what the actor used before it took the trainer's settings)
        at_one = _reference_logprobs(model, tokens, lengths, temperature=1.0)
        assert (logprobs[mask] - at_one[mask]).abs().max() > 0.05


def test_min_length_ban_is_part_of_the_scored_distribution(tmp_path):
    actor = _recording_actor()
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0, **{"length.min_length": 3})
    make_trainer(tmp_path, cfg, actor=actor).fit()
    _, tokens, lengths, prompts, logprobs, model = actor.calls[0]
    width = tokens.shape[1] - 1
    # position t predicts token t+1, response token j = t + 1 - prompt_length; EOS (1) banned for j < 3
    j = torch.arange(width)[None, :] + 1 - prompts[:, None]
    banned = ((j >= 0) & (j < 3))[..., None] & (torch.arange(SIZE.vocab_size) == 1)
    mask = _response_mask(prompts, lengths, width)
    expected = _reference_logprobs(model, tokens, lengths, 1.0, banned=banned)
    assert torch.allclose(logprobs[mask], expected[mask], atol=1e-5)
    unbanned = _reference_logprobs(model, tokens, lengths, 1.0)
    early = mask & (j < 3)
    assert (logprobs[early] - unbanned[early]).abs().min() > 1e-3  # the ban changed every early token
    # generation banned it too: no response ends before its third token
    assert ((lengths - prompts) >= 3).all()


@pytest.mark.parametrize("override", ["sampling.top_k=5", "sampling.top_p=0.9"])
def test_truncated_sampling_is_refused_for_training(override):
    with pytest.raises(ConfigError, match=r"full softmax.*NeMo-Aligner issue #46"):
        ppo_cfg(**dict([override.split("=")]))


class RecordingScorer(TargetTokenScorer):
    def __init__(self):
        super().__init__()
        self.batches = []

    def infer_rm_critic(self, batch):
        self.batches.append(batch)
        return super().infer_rm_critic(batch)


def test_responses_end_on_the_tokenizer_eos_when_the_model_config_says_otherwise(tmp_path, caplog):
    tokenizer = build_char_tokenizer("abcd")
    size = TinySize(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, max_positions=64)
    model = build_tiny_causal_lm("gpt2", size, seed=0)
    config_eos = tokenizer.convert_tokens_to_ids("a")
    model.config.eos_token_id = config_eos  # a custom tokenizer's EOS differs from the config's
    with caplog.at_level(logging.WARNING):
        actor = CausalLMActor(model, tokenizer)
    assert f"the tokenizer's EOS id {tokenizer.eos_token_id}" in caplog.text
    assert f"model config's eos_token_id {config_eos}" in caplog.text
    scorer = RecordingScorer()
    cfg = ppo_cfg(max_steps=2, val_check_interval=0, save_interval=0, **{"sampling.stop_token_ids": "null"})
    prompts = [[tokenizer.bos_token_id, 4 + i % 4] for i in range(32)]
    history = make_trainer(tmp_path, cfg, actor=actor, client=scorer, prompts=prompts).fit()
    ended = 0
    for b in scorer.batches:
        last = b["response_tokens"][torch.arange(len(b["is_end"])), b["response_lengths"] - 1]
        assert (last[b["is_end"]] == tokenizer.eos_token_id).all()
        ended += int(b["is_end"].sum())
    assert ended > 0
    assert all(m["rollout/fraction_of_samples_properly_ended"] > 0 for m in history)
    assert all(m["policy/loss"] != 0.0 for m in history)


def test_a_response_ended_by_a_stop_string_keeps_its_last_token_in_the_text(tmp_path):
    tokenizer = build_char_tokenizer("abcd")
    size = TinySize(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, max_positions=64)
    actor = CausalLMActor(build_tiny_causal_lm("gpt2", size, seed=0), tokenizer)
    scorer, texts = RecordingScorer(), []

    def score(prompts, responses):
        texts.extend(responses)
        return [0.0] * len(responses)

    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0, **{"sampling.end_strings": '["b"]'})
    prompts = [[tokenizer.bos_token_id, 4 + i % 4] for i in range(32)]
    make_trainer(tmp_path, cfg, actor=actor, client=scorer, prompts=prompts, scorer=score).fit()
    is_end = torch.cat([b["is_end"] for b in scorer.batches])
    last = torch.cat(
        [b["response_tokens"][range(len(b["is_end"])), b["response_lengths"] - 1] for b in scorer.batches]
    )
    b_id, eos = tokenizer.convert_tokens_to_ids("b"), tokenizer.eos_token_id
    by_string = is_end & (last == b_id)
    assert by_string.any() and (is_end & (last == eos)).any()
    for i in range(len(texts)):
        if by_string[i]:
            assert texts[i].endswith(str(b_id)), texts[i]  # the "b" stays in the text
        elif is_end[i]:
            assert not texts[i].endswith(f" {eos}")  # the EOS id does not


def test_configured_stop_ids_add_to_the_tokenizer_eos():
    cfg = ppo_cfg(**{"sampling.stop_token_ids": "[5,9]"})
    assert cfg.sampling_params([1]).stop_token_ids == (1, 5, 9)


class NaNLoss(PolicyLoss):
    """The loss is NaN in the micro-batches listed in ``nan_micro_batches`` (0-based, in call order)."""

    nan_micro_batches: set[int]
    seen = 0

    def __call__(self, policy, batch):
        loss, metrics = super().__call__(policy, batch)
        index, self.seen = self.seen, self.seen + 1
        return (loss * float("nan") if index in self.nan_micro_batches else loss), metrics


def nan_loss(cfg, micro_batches) -> NaNLoss:
    loss = NaNLoss(PolicyLossConfig.from_ppo(cfg))
    loss.nan_micro_batches = set(micro_batches)
    return loss


def test_inf_nan_gradients_skip_the_optimizer_step(tmp_path):
    # (gate_unfinished=False: a micro-batch whose samples are all gated has an exactly-zero
    # gradient even under a NaN loss, as masked positions are selected away)
    # 16 rollouts / global batch 8 = 2 optimizer steps per PPO step, 2 micro-batches each
    actor = CausalLMActor(build_tiny_causal_lm("gpt2", SIZE, seed=0))
    before = [p.detach().clone() for p in actor.parameters()]
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0, gate_unfinished=False)
    # a NaN micro-batch in each optimizer step of PPO step 1
    trainer = make_trainer(tmp_path, cfg, actor=actor, loss=nan_loss(cfg, {0, 3}))
    (m,) = trainer.fit()
    assert m["policy/skipped_steps"] == 2.0 and m["policy/optim_step"] == 0.0
    for a, b in zip(before, actor.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(not s for s in trainer.optimizer.state.values())  # no moment was written either
    assert trainer.nonfinite_in_a_row == 2


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path):
    cfg = ppo_cfg(max_steps=3, max_epochs=2, val_check_interval=0, save_interval=0, gate_unfinished=False)
    loss = nan_loss(cfg, set(range(100)))
    trainer = make_trainer(tmp_path, cfg, loss=loss)
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row"):
        trainer.fit()
    assert trainer.step == 1  # stopped in the second PPO step, at its first skipped step (3rd in a row)


def test_a_finite_step_resets_the_count(tmp_path):
    cfg = ppo_cfg(max_steps=3, max_epochs=2, val_check_interval=0, save_interval=0, gate_unfinished=False)
    loss = nan_loss(cfg, {0, 2, 6, 8})  # optimizer steps 1, 2, 4, 5 of 6: never 3 in a row
    history = make_trainer(tmp_path, cfg, loss=loss).fit()
    assert [m["policy/skipped_steps"] for m in history] == [2.0, 1.0, 1.0]


def test_fp16_overflows_count_toward_the_limit_only_once_the_loss_scale_cannot_explain_them(tmp_path):
    # a NaN loss under fp16 loss scaling: the scaler halves its scale after each skipped step
    # (2^16 → below 1 in 17 steps); only then do the skips count toward the limit of 3
    cfg = ppo_cfg(max_steps=20, max_epochs=20, val_check_interval=0, save_interval=0, gate_unfinished=False)
    loss = nan_loss(cfg, set(range(1000)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer = make_trainer(tmp_path, cfg, loss=loss, grad_scaler=scaler)
    with pytest.raises(NonFiniteTrainingError):
        trainer.fit()
    assert trainer.nonfinite_steps == 17 + 3 and scaler.get_scale() < 1.0
