"""The canonical PPO step on Hugging Face TRL's PPO trainer (``trl.experimental.ppo``), the peer.

Workload (/work/shared/bench/workload.md), set up as in ``bench_ppo_step.py``: policy, reference
policy, value model and reward model are the canonical GPT-2 (n_layer=4, n_embd=256, n_head=4,
vocab 512, n_positions=256, random init, seed 0, fp32) — value and reward model as one-label
``GPT2ForSequenceClassification`` as TRL expects; 512 prompts of exactly 32 ids from 3..511 (seed
0); one PPO step = 64 prompts → 64 responses of exactly 64 new tokens (no stop token, temperature
1), 4 minibatches of 16 each with its own optimizer step, 1 PPO epoch, KL coefficient 0.05, lr
1e-5. TRL's defaults that differ from the workload are overridden: fp32 instead of bf16, no
gradient checkpointing, 1 PPO epoch instead of 4, no sample generations, constant learning rate.
TRL keeps every model in this one process (the value model trains with the policy, through one
optimizer); rollouts are generated 64 at a time (``local_rollout_forward_batch_size``, its
default).

Step times are taken by a ``TrainerCallback`` at ``on_step_end`` (step 1 from ``on_train_begin``);
``generate`` is the time spent in TRL's ``batch_generation``, ``update`` from the first
training-mode forward of a step to its end, ``score`` the rest (reference log-probs, values,
rewards, advantages). Reports the median over steps 2..N (``--steps``, default 6). Prints one
JSON object. Needs the ``bench`` extra (``pip install -e ".[bench]"``; TRL ≤ 1.12.0). Usage:
``python benchmarks/bench_trl_ppo.py [--steps 6] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, ROLLOUTS, MINIBATCHES = 512, 32, 64, 64, 4


class _StepClock:
    """Wall-clock marks of TRL's loop: train begin, each step end, generation and update starts."""

    def __init__(self) -> None:
        self.begin = 0.0
        self.ends: list[float] = []
        self.generate_s: list[float] = []
        self.new_tokens: list[int] = []
        self.update_start: list[float] = []

    def phases(self) -> list[dict[str, float]]:
        starts = [self.begin, *self.ends[:-1]]
        out = []
        for i, (start, end) in enumerate(zip(starts, self.ends, strict=True)):
            update = end - self.update_start[i]
            generate = self.generate_s[i]
            out.append(
                {
                    "step_s": end - start,
                    "generate_s": generate,
                    "score_s": end - start - generate - update,
                    "update_s": update,
                }
            )
        return out


def _instrument(clock: _StepClock) -> None:
    """Wrap TRL's module-level ``batch_generation`` and ``forward`` to mark the phases."""
    from trl.experimental.ppo import ppo_trainer

    generate, forward = ppo_trainer.batch_generation, ppo_trainer.forward

    def timed_generation(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        query_responses, logits = generate(*args, **kwargs)
        clock.generate_s.append(time.perf_counter() - t0)
        clock.new_tokens.append(int(logits.shape[1]))  # one score row per generated position
        return query_responses, logits

    def marked_forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The policy+value wrapper is forwarded in training mode only in the update phase.
        if model.training and len(clock.update_start) == len(clock.ends):
            clock.update_start.append(time.perf_counter())
        return forward(model, *args, **kwargs)

    ppo_trainer.batch_generation = timed_generation
    ppo_trainer.forward = marked_forward


def run(steps: int, threads: int) -> dict[str, Any]:
    """Train TRL's PPO for ``steps`` steps on the workload; the result dict (see the module doc)."""
    torch.set_num_threads(threads)
    import accelerate
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from openaligner.models.builders import (
        WORKLOAD_SIZE,
        build_tiny_causal_lm,
        build_tiny_sequence_classifier,
    )
    from openaligner.models.tokenizers import build_word_tokenizer

    clock = _StepClock()
    _instrument(clock)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            clock.begin = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            clock.ends.append(time.perf_counter())

    # Ids 0..511 with <pad>=0, <eos>=1, <bos>=2, <unk>=3; the prompts are ids only, never text.
    tokenizer = build_word_tokenizer([f"w{i}" for i in range(4, WORKLOAD_SIZE.vocab_size)])
    assert len(tokenizer) == WORKLOAD_SIZE.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (PROMPTS, PROMPT_TOKENS), generator=g).tolist()
    dataset = Dataset.from_dict({"input_ids": prompts})

    policy = build_tiny_causal_lm("gpt2", WORKLOAD_SIZE, seed=0)
    reference = build_tiny_causal_lm("gpt2", WORKLOAD_SIZE, seed=0)
    reward = build_tiny_sequence_classifier("gpt2", WORKLOAD_SIZE, seed=0)
    value = build_tiny_sequence_classifier("gpt2", WORKLOAD_SIZE, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        config = PPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            num_ppo_epochs=1,
            num_mini_batches=MINIBATCHES,
            per_device_train_batch_size=ROLLOUTS,
            gradient_accumulation_steps=1,
            local_rollout_forward_batch_size=ROLLOUTS,
            total_episodes=ROLLOUTS * steps,
            response_length=NEW_TOKENS,
            stop_token=None,
            stop_token_id=None,
            missing_eos_penalty=None,
            temperature=1.0,
            kl_coef=0.05,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            num_sample_generations=0,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        # TRL prints its logs; stdout carries only this script's JSON.
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            trainer = PPOTrainer(
                args=config,
                processing_class=tokenizer,
                model=policy,
                ref_model=reference,
                reward_model=reward,
                train_dataset=dataset,
                value_model=value,
                eval_dataset=dataset.select(range(ROLLOUTS)),
                callbacks=[Clock()],
            )
            trainer.train()
        logs = [h for h in trainer.state.log_history if "objective/scores" in h]

    per_step = clock.phases()
    measured = per_step[1:]  # steps 2..N
    step_s = statistics.median(p["step_s"] for p in measured)
    return {
        "benchmark": "trl_ppo_step",
        "steps_measured": len(measured),
        "median_step_s": round(step_s, 3),
        "min_step_s": round(min(p["step_s"] for p in measured), 3),
        "tokens_per_s": round(ROLLOUTS * (PROMPT_TOKENS + NEW_TOKENS) / step_s, 1),
        "phase_median_s": {
            k: round(statistics.median(p[k] for p in measured), 3)
            for k in ("generate_s", "score_s", "update_s")
        },
        "all_step_s": [round(p["step_s"], 3) for p in per_step],
        "new_tokens_per_step": clock.new_tokens,
        # <eos> sampled by chance inside responses (it does not stop generation here).
        "eos_tokens_per_step": [int(h["val/num_eos_tokens"]) for h in logs],
        "threads": torch.get_num_threads(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "accelerate": accelerate.__version__,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args()
    print(json.dumps(run(ns.steps, ns.threads), indent=1))


if __name__ == "__main__":
    main()
