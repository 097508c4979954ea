"""Runs a tiny PPOTrainer for 2 steps on 1 process or under torchrun; writes rank 0's metrics as JSON.

Used by test_ppo_distributed.py: ``python ppo_dp_worker.py OUT [FAIL_AT]`` or
``torchrun --nproc_per_node 2 ppo_dp_worker.py OUT [FAIL_AT]``. With ``FAIL_AT`` = N the N-th
``critic_train`` answer is an error; every rank then writes ``OUT.rank<r>`` (the error it stopped
with and when) and exits 3. ``STRATEGY=fsdp`` in the environment shards the actor and its initial
policy (``parallel.strategy``) as train-ppo does, ``GENERATION=layerwise`` generates layer by layer
(``parallel.generation``), ``OFFLOAD=1`` puts the shards of both (with the actor's gradients and
optimizer state) in CPU memory; ``ARCH`` picks the tiny model (default gpt2).

Checkpoints (test_ppo_checkpoints.py): ``CHECKPOINTS=<dir>`` saves after every step there and first
resumes from the newest one there, as train-ppo does; ``STEPS`` is ``max_steps`` (default 2);
``OPTIM=adamw`` trains with AdamW and a decaying LR schedule (optimizer state and schedule to
checkpoint) instead of plain SGD. ``EXPORT=<dir>`` writes the final actor there as train-ppo does
(``CausalLMActor.save_pretrained``, on every rank when sharded). ``ESTIMATOR=grpo`` (or another
critic-free estimator) samples 4 prompts × 4 responses a step instead of 16 × 1 and trains no critic.
``MICRO_BATCH`` is ``trainer.micro_batch_size`` (default 2), ``GLOBAL_BATCH`` its
``global_batch_size`` (default 8; 16, the whole rollout, makes a critic-free run's update
on-policy), ``REUSE=0`` sets ``reuse_update_logprobs=false``. Rank 0 also writes the final weights
to ``OUT`` with the suffix ``.pt`` (a state dict) for an element-wise comparison.
"""

import json
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch
from ppo_fakes import Done, target_share

from openaligner import distributed as dp
from openaligner.config import load_config
from openaligner.io.checkpoint import CheckpointManager
from openaligner.io.metrics import MetricsLogger
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.sharding import ActorParallelConfig, full_state_dict, shard
from openaligner.trainer.ppo import ActorOptim, PPOTrainer, Prompts, RunOutputs
from openaligner.trainer.ppo_checkpoint import restore_newest_checkpoint
from openaligner.trainer.ppo_config import PPOConfig
from openaligner.trainer.ppo_recipe import build_init_policy
from openaligner.trainer.rollout import PromptLoader, make_prompt_collate


class CriticTrainFailed(RuntimeError):
    pass


class Scorer:
    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.train_calls = 0

    def infer_rm_critic(self, batch):
        values = 0.1 * (batch["response_tokens"][:, 1:] % 3).float()  # values that depend on the tokens
        return Done((target_share(batch), values))

    def train(self, data):
        assert not os.environ.get("ESTIMATOR"), "a critic-free estimator trained a critic"
        self.train_calls += 1
        f = Future()
        if self.train_calls == self.fail_at:
            f.set_exception(CriticTrainFailed("critic_train answered 400: bad request"))
            return f
        f.set_result(
            {"loss": float((data["returns"] * data["mask"]).sum()), "rows": float(len(data["mask"]))}
        )
        return f

    def save(self):
        f = Future()
        f.set_result(0)
        return f


def main(out: Path, fail_at: int | None = None) -> None:
    torch.set_num_threads(1)
    dp.init_from_env()
    checkpoint_dir = os.environ.get("CHECKPOINTS")
    estimator = os.environ.get("ESTIMATOR")
    critic_free = (
        [f"advantage_estimator={estimator}", "n_samples_per_prompt=4", "num_rollout_samples=4"]
        if estimator
        else []
    )
    cfg = load_config(
        PPOConfig,
        None,
        [
            "num_rollout_samples=16",
            "rollout_micro_batch_size=4",
            f"global_batch_size={os.environ.get('GLOBAL_BATCH', '8')}",
            f"reuse_update_logprobs={os.environ.get('REUSE', '1') == '1'}",
            f"micro_batch_size={os.environ.get('MICRO_BATCH', '2')}",
            "length.max_length=5",
            "val_check_interval=0",
            f"save_interval={1 if checkpoint_dir else 0}",
            f"max_steps={os.environ.get('STEPS', '2')}",
            "max_epochs=2",
            "initial_policy_kl_penalty=0.05",
            # adaptive β with a short horizon: any rank-local statistic would split β across ranks
            "adaptive_kl=true",
            "kl_target=0.01",
            "kl_horizon=20",
            "sampling.stop_token_ids=[1]",
            "gate_unfinished=false",
            *critic_free,
        ],
    )
    offload = os.environ.get("OFFLOAD") == "1"
    parallel = ActorParallelConfig(
        strategy=os.environ.get("STRATEGY", "ddp"),
        generation=os.environ.get("GENERATION", "gathered"),
        offload=offload,
        offload_init_policy=offload,
    )
    size = TinySize(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2)
    model = build_tiny_causal_lm(os.environ.get("ARCH", "gpt2"), size, seed=0)
    init = build_init_policy(model, parallel)
    actor = CausalLMActor(
        shard(model, parallel),
        init_policy=init,
        gather_for_generation=parallel.generation == "gathered",
    )
    prompts = [[3 + (i % 20), 4 + (i % 7), 5][: 1 + i % 3] for i in range(32)]
    scheduler = None
    if os.environ.get("OPTIM") == "adamw":
        opt = torch.optim.AdamW(actor.parameters(), lr=0.02)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    else:
        opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    logs = MetricsLogger(out.with_suffix(".logs"), tensorboard=False, enabled=dp.rank() == 0)
    checkpoints = CheckpointManager(checkpoint_dir) if checkpoint_dir else None
    scorer = Scorer(fail_at)
    trainer = PPOTrainer(
        cfg,
        actor,
        ActorOptim(opt, scheduler),
        Prompts(
            train=PromptLoader(prompts, cfg.num_rollout_samples, cfg.seed, True, dp.rank(), dp.world_size()),
            val=None,
            collate=make_prompt_collate(actor.pad_id),
        ),
        scorer,
        RunOutputs(logger=logs, checkpoints=checkpoints, progress=False),
    )
    latest = restore_newest_checkpoint(checkpoints, scorer) if checkpoints is not None else None
    if latest is not None:
        trainer.load_checkpoint(latest)
    if fail_at is not None:
        started = time.monotonic()
        try:
            trainer.fit()
        except Exception as e:
            report = {"error": type(e).__name__, "message": str(e), "after_s": time.monotonic() - started}
            Path(f"{out}.rank{dp.rank()}").write_text(json.dumps(report))
            sys.exit(3)
        raise AssertionError("the failed critic_train did not stop the run")
    history = trainer.fit()
    if os.environ.get("EXPORT"):
        actor.save_pretrained(os.environ["EXPORT"])  # a collective when sharded
    state = full_state_dict(actor.model)  # the whole weights (a collective when sharded)
    betas = dp.gather_objects(trainer.kl_controller.value)
    if dp.rank() == 0:
        assert state is not None
        weights = {k: float(v.double().sum()) for k, v in state.items()}
        torch.save(state, out.with_suffix(".pt"))
        out.write_text(json.dumps({"history": history, "weights": weights, "betas": betas}))
    dp.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
    sys.exit(dp.finish(0))  # a rank skips interpreter teardown (distributed.finish says why)
