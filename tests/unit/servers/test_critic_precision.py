"""The critic server's precision: a bfloat16-stored critic trains float32 masters whose values move
toward the returns as far as those of a float32-stored copy; inference and training forwards run
under the precision's autocast, fp16 loss scaling skips overflowing steps, and serve-critic /
serve-reward load the trained critic as masters and the frozen reward model in the compute dtype.

The learning rate is of the order of a real critic's (serve-critic's default is 9e-6): there an
Adam update is below half a bfloat16 ulp of most weights. Before float32 masters the bf16-stored
critic moved its values 0.040 toward the target in 10 steps, the fp32-stored one 0.192. (At
lr 1e-3 the float32 scalar head alone moves the values and the two look alike.)"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.source import ModelSourceConfig, load_critic
from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

SIZE = TinySize(vocab_size=64, hidden_size=128, num_layers=2, num_heads=2, max_positions=64)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """``bf16/``: a tiny reward model (the critic's start) saved in bfloat16; ``fp32/``: the same
    weights saved in float32."""
    root = tmp_path_factory.mktemp("stored")
    model = build_tiny_sequence_classifier("llama", SIZE, seed=0).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    model.float().save_pretrained(root / "fp32")
    return root


def server(critic, precision=None, lr=1e-5):
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=8, micro_batch_size=4, loss_clip_val=0.0),
        critic,
        torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=0.0),
        precision=precision,
    )
    return CriticServerTrainer(
        CriticServerConfig(combine_rm_and_critic_server=False, model_forward_micro_batch_size=8),
        trainer,
        None,
    )


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, SIZE.vocab_size, (8, 10), generator=g)
    return tokens, torch.full((8,), 10)


def values(trainer, tokens, lengths):
    out = trainer.run_inference(tokens=tokens.numpy(), sequence_lengths=lengths.numpy().reshape(-1, 1))
    return torch.from_numpy(out["values"])[:, :-1]


def movement_toward_target(trainer, steps=10):
    """Mean move of the values after ``steps`` critic_train passes toward returns = values + 1."""
    tokens, lengths = batch()
    start = values(trainer, tokens, lengths)
    mask = np.ones(start.shape, np.float32)
    for _ in range(steps):
        trainer.run_training(
            tokens=tokens.numpy(),
            returns=(start + 1).numpy(),
            prev_values=start.numpy(),
            mask=mask,
        )
    return float((values(trainer, tokens, lengths) - start).mean())


def test_a_bf16_stored_critic_moves_its_values_as_far_as_its_fp32_stored_copy(stored):
    critic = load_critic(ModelSourceConfig(path=str(stored / "bf16")), SIZE.vocab_size, CPU)
    from_bf16 = movement_toward_target(server(critic))
    from_fp32 = movement_toward_target(
        server(load_critic(ModelSourceConfig(path=str(stored / "fp32")), SIZE.vocab_size, CPU))
    )
    assert from_fp32 > 0.1
    assert from_bf16 >= 0.95 * from_fp32, f"bf16-stored moved {from_bf16:.3f}, fp32-stored {from_fp32:.3f}"
    assert {p.dtype for p in critic.parameters()} == {torch.float32}


def test_under_bf16_mixed_the_critic_moves_as_far_and_serves_float32_values(stored):
    from openaligner.models.precision import Precision

    mixed = Precision.resolve("bf16-mixed", CPU)
    critic = load_critic(ModelSourceConfig(path=str(stored / "bf16")), SIZE.vocab_size, CPU)
    trainer = server(critic, mixed)
    seen: list[torch.dtype] = []
    hook = critic.hf_model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype)
    )
    try:
        from_bf16 = movement_toward_target(trainer)
    finally:
        hook.remove()
    from_fp32 = movement_toward_target(
        server(load_critic(ModelSourceConfig(path=str(stored / "fp32")), SIZE.vocab_size, CPU))
    )
    assert set(seen) == {torch.bfloat16}  # infer and train forwards ran under autocast
    assert from_bf16 >= 0.95 * from_fp32, f"bf16-mixed moved {from_bf16:.3f}, fp32 {from_fp32:.3f}"
    assert {p.dtype for p in critic.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in trainer.trainer.optimizer.state.values()} == {torch.float32}
    tokens, lengths = batch()
    served = trainer.run_inference(tokens=tokens.numpy(), sequence_lengths=lengths.numpy().reshape(-1, 1))
    assert served["values"].dtype == np.float32


def test_fp16_loss_scaling_skips_an_overflowing_critic_step_and_lowers_the_scale(stored):
    from openaligner.models.precision import Precision

    critic = load_critic(ModelSourceConfig(path=str(stored / "fp32")), SIZE.vocab_size, CPU)
    trainer = server(critic, Precision.resolve("fp16-mixed", CPU))
    trainer.trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # the scaled loss overflows
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    tokens, lengths = batch()
    start = values(trainer, tokens, lengths)
    inputs = dict(
        tokens=tokens.numpy(),
        returns=(start + 1).numpy(),
        prev_values=start.numpy(),
        mask=np.ones(start.shape, np.float32),
    )
    trainer.run_training(**inputs)
    assert trainer.step == 0 and trainer.trainer.scaler.get_scale() == 2.0**119
    assert all(torch.equal(v, before[k]) for k, v in critic.state_dict().items())
    trainer.trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.run_training(**inputs)
    assert trainer.step == 1
    assert not all(torch.equal(v, before[k]) for k, v in critic.state_dict().items())


def test_serve_critic_and_serve_reward_load_masters_and_compute_dtype_models():
    from openaligner.cli import serve_critic, serve_reward
    from openaligner.config import load_config
    from openaligner.models.precision import Precision

    mixed = Precision.resolve("bf16-mixed", CPU)
    log = logging.getLogger("test")
    overrides = ["model.tiny=gpt2", "runtime.precision=bf16-mixed"]
    cfg = load_config(serve_critic.ServeCriticConfig, None, overrides)
    critic, reward_model, _ = serve_critic.load_models(cfg, CPU, mixed, log)
    assert {p.dtype for p in critic.parameters()} == {torch.float32}  # trained: masters
    assert reward_model.backbone.get_input_embeddings().weight.dtype == torch.bfloat16  # frozen: compute
    assert reward_model.head.weight.dtype == torch.float32
    reward_cfg = load_config(serve_reward.ServeRewardConfig, None, ["model.tiny=gpt2"])
    model, _ = serve_reward.load_model(reward_cfg, CPU, mixed, log)
    assert model.backbone.get_input_embeddings().weight.dtype == torch.bfloat16
    rewards = mixed.autocast_fn(model.infer)(torch.randint(4, 90, (2, 5)), torch.tensor([5, 3]))
    assert rewards.dtype == torch.float32
