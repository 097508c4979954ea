"""Step time with and without the rollout log-prob pass of an on-policy update
(``trainer.reuse_update_logprobs``, docs/ppo.md), side by side in one process.

Workload: the canonical GPT-2 shape (/work/shared/bench/workload.md: n_layer=4, n_embd=256,
n_head=4, vocab 512, random init, seed 0, fp32) as the actor, with its frozen copy as the initial
policy; GRPO, 16 prompts of 32 token ids × 4 responses of exactly 64 new tokens per step
(no stop token), the whole rollout of 64 in one optimizer step (``global_batch_size=64``,
``micro_batch_size=16``) — the walkthrough's shape of update, where the skip applies —, the KL
as a loss term (β 0.05), AdamW lr 1e-5. The reward is computed in this process (a token's share
of the response), so that the step is the actor's work only. Each round runs ``--steps`` steps
with the pass (``reuse_update_logprobs=false``) and then as many without, in a fresh trainer from
the same weights; reports per setting the median over rounds of the median step time over steps
2..N and of each phase, and the ratio. Prints one JSON object. Usage:
``python benchmarks/bench_on_policy_logprobs.py [--steps 5] [--rounds 3] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from openaligner.config import load_config
from openaligner.io.metrics import MetricsLogger
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.trainer.ppo import ActorOptim, PPOTrainer, Prompts, RunOutputs
from openaligner.trainer.ppo_config import PPOConfig
from openaligner.trainer.rollout import PromptLoader, make_prompt_collate

SIZE = TinySize(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, max_positions=256)
PHASES = ("timing/generate_s", "timing/logprobs_s", "timing/init_logprobs_s", "timing/train_s")


class ShareReward:
    """Reward = the share of token 7 in each response; no critic (GRPO needs none)."""

    def infer_rm_critic(self, batch: dict[str, torch.Tensor]) -> Future[Any]:
        tokens, lengths = batch["response_tokens"], batch["response_lengths"]
        prompts = batch["prompt_lengths"]
        pos = torch.arange(tokens.shape[1])
        resp = (pos >= prompts[:, None]) & (pos < lengths[:, None])
        share = (((tokens == 7) & resp).sum(-1) / resp.sum(-1).clamp_min(1)).float()
        f: Future[Any] = Future()
        f.set_result((share, None))
        return f


def run(reuse: bool, steps: int, out: Path) -> list[dict[str, float]]:
    cfg = load_config(
        PPOConfig,
        None,
        [
            "advantage_estimator=grpo",
            "num_rollout_samples=16",
            "n_samples_per_prompt=4",
            "rollout_micro_batch_size=64",
            "global_batch_size=64",
            "micro_batch_size=16",
            "length.max_length=64",
            "length.min_length=64",
            "gate_unfinished=false",  # fixed-length responses: none ends on a stop token
            f"max_steps={steps}",
            "val_check_interval=0",
            "save_interval=0",
            "sample_table_interval=0",
            "rollout_log_rows=0",
            "initial_policy_kl_penalty=0.05",
            "seed=0",
            f"reuse_update_logprobs={reuse}",
        ],
    )
    model = build_tiny_causal_lm("gpt2", SIZE, seed=0)
    actor = CausalLMActor(model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (512, 32), generator=g).tolist()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    trainer = PPOTrainer(
        cfg,
        actor,
        ActorOptim(opt),
        Prompts(
            train=PromptLoader(prompts, cfg.num_rollout_samples, cfg.seed, shuffle=True),
            val=None,
            collate=make_prompt_collate(actor.pad_id),
        ),
        ShareReward(),
        RunOutputs(logger=MetricsLogger(out / "logs", tensorboard=False), progress=False),
    )
    return trainer.fit()


def summary(history: list[dict[str, float]]) -> dict[str, float]:
    later = history[1:]  # step 1 warms up allocators and the head check
    return {key: statistics.median(m.get(key, 0.0) for m in later) for key in ("timing/step_s", *PHASES)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds: dict[str, list[dict[str, float]]] = {"pass": [], "skip": []}
    losses: dict[str, list[float]] = {"pass": [], "skip": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, reuse in (("pass", False), ("skip", True)):
                history = run(reuse, args.steps, Path(tmp) / f"{name}{r}")
                rounds[name].append(summary(history))
                losses[name].append(history[-1]["policy/loss"])
    result: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
    }
    for name, per_round in rounds.items():
        result[name] = {k: statistics.median(s[k] for s in per_round) for k in per_round[0]}
        result[name]["last_policy_loss"] = losses[name]
    result["step_ratio_skip_over_pass"] = result["skip"]["timing/step_s"] / result["pass"]["timing/step_s"]
    result["same_losses"] = losses["pass"] == losses["skip"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
