"""Actor update FLOP/s against this machine's fp32 matmul peak, measured in the same run.

The actor update of one canonical PPO step (/work/shared/bench/workload.md), alone in this
process: ``PPOTrainer.run_training`` on one rollout of 64 rows × 96 tokens (32 prompt + 64
response), 4 minibatches of 16, one AdamW step each, 1 PPO epoch, the canonical GPT-2 policy
(fp32, ``torch.set_num_threads(--threads)``). The rollout is synthetic (uniform token ids, the
policy's own log-probs as ``prev_logprobs``, standard-normal advantages): the update's cost does
not depend on the values.

FLOPs are counted analytically (``flops.py``): 6·N + 12·L·d·S per token, forward + backward,
× 64 × 96 tokens. The peak is the best fp32 ``2048 × 2048`` matmul at the same thread count,
taken before and after the updates (the larger counts). Reports the median update over
``--repeats`` after one warm-up. ``--profile FILE`` also writes a ``torch.profiler`` table of
one update (ops by self CPU time). Prints one JSON object. Usage:
``python benchmarks/bench_actor_update.py [--repeats 5] [--threads 2] [--profile FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flops import gpt2_shape, matmul_peak_flop_per_s

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, ROLLOUTS = 512, 32, 64, 64


def _trainer(actor: Any, work: Path) -> Any:
    """A PPOTrainer around ``actor`` configured as the workload's actor update (no servers)."""
    from openaligner.config import load_config
    from openaligner.io.metrics import MetricsLogger
    from openaligner.trainer.ppo import ActorOptim, PPOTrainer, Prompts, RunOutputs
    from openaligner.trainer.ppo_config import PPOConfig
    from openaligner.trainer.rollout import PromptLoader, make_prompt_collate

    cfg = load_config(
        PPOConfig,
        None,
        [
            f"num_rollout_samples={ROLLOUTS}",
            "rollout_micro_batch_size=16",
            "global_batch_size=16",
            "micro_batch_size=16",
            "ppo_epochs=1",
            "gate_unfinished=false",
            "val_check_interval=0",
            "save_interval=0",
            "seed=0",
        ],
    )
    prompts = [[3] * PROMPT_TOKENS] * PROMPTS
    return PPOTrainer(
        cfg,
        actor,
        ActorOptim(torch.optim.AdamW(actor.parameters(), lr=1e-5, fused=True)),  # as train-ppo
        Prompts(train=PromptLoader(prompts, ROLLOUTS, 0, True), val=None, collate=make_prompt_collate(0)),
        None,  # type: ignore[arg-type]  # run_training never calls the reward/critic client
        RunOutputs(logger=MetricsLogger(work / "logs", tensorboard=False), progress=False),
    )


def _rollout(actor: Any) -> Any:
    from openaligner.trainer.ppo_data import PPOData

    g = torch.Generator().manual_seed(0)
    seq = PROMPT_TOKENS + NEW_TOKENS
    tokens = torch.randint(3, 512, (ROLLOUTS, seq), generator=g)
    mask = torch.zeros(ROLLOUTS, seq - 1)
    mask[:, PROMPT_TOKENS - 1 :] = 1.0  # position t scores token t+1: the response positions
    advantages = torch.randn(ROLLOUTS, seq - 1, generator=g) * mask
    return PPOData(
        sequence_tokens=tokens,
        prompt_lengths=torch.full((ROLLOUTS,), PROMPT_TOKENS),
        is_end=torch.zeros(ROLLOUTS, dtype=torch.bool),
        mask=mask,
        prev_logprobs=actor.get_inference_log_probs(tokens),
        advantages=advantages,
        returns=torch.zeros(ROLLOUTS, seq - 1),
        values=torch.zeros(ROLLOUTS, seq - 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", type=Path, default=None)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)

    import transformers

    from openaligner.models.actor import CausalLMActor
    from openaligner.models.builders import WORKLOAD_SIZE, build_tiny_causal_lm

    peak_before = matmul_peak_flop_per_s(ns.threads)
    actor = CausalLMActor(build_tiny_causal_lm("gpt2", WORKLOAD_SIZE, seed=0))
    shape = gpt2_shape(actor.model.config)
    seq = PROMPT_TOKENS + NEW_TOKENS
    flops = shape.train_flops_per_token(seq) * ROLLOUTS * seq
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(actor, Path(tmp))
        data = _rollout(actor)
        trainer.run_training(data)  # warm-up
        times = []
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            trainer.run_training(data)
            times.append(time.perf_counter() - t0)
        if ns.profile is not None:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.run_training(data)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            ns.profile.write_text(table)
    peak = max(peak_before, matmul_peak_flop_per_s(ns.threads))
    update_s = statistics.median(times)
    achieved = flops / update_s
    result = {
        "benchmark": "actor_update",
        "repeats": ns.repeats,
        "median_update_s": round(update_s, 3),
        "all_update_s": [round(t, 3) for t in times],
        "flops_per_update": flops,
        "flops_formula": "(6*N + 12*L*d*S) * rows * S",
        "matmul_params_N": shape.matmul_params,
        "achieved_gflop_per_s": round(achieved / 1e9, 1),
        "matmul_peak_gflop_per_s": round(peak / 1e9, 1),
        "peak_fraction": round(achieved / peak, 3),
        "threads": ns.threads,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
