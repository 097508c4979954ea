"""The PPO recipe with a LoRA actor (`lora.r` in train-ppo's config), against the in-memory
reward/critic stand-in: the initial policy is the actor itself with its adapters disabled, only
the adapters train, adapter checkpoints resume exactly, and the merged actor reloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ppo_fakes import TargetTokenScorer
from transformers import AutoModelForCausalLM

from openaligner.config import load_config
from openaligner.models.lora import is_peft_model
from openaligner.trainer.ppo_config import TrainPPOConfig
from openaligner.trainer.ppo_recipe import prepare_ppo_run, run_ppo

pytest.importorskip("peft")


def _cfg(tmp_path: Path, out: str, *overrides: str) -> TrainPPOConfig:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        words = ["add", "sort", "the", "list", "now", "please"]
        rows = [{"prompt": " ".join(words[(i + k) % 6] for k in range(1 + i % 3))} for i in range(32)]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        TrainPPOConfig,
        overrides=[
            "actor.tiny_hidden_size=32",
            "actor.tiny_num_layers=1",
            "actor.tiny_num_heads=2",
            "device=cpu",
            f"data.train_path={prompts}",
            "data.seq_length=48",
            "trainer.num_rollout_samples=8",
            "trainer.rollout_micro_batch_size=8",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.val_check_interval=0",
            "trainer.save_interval=1",
            "trainer.length.max_length=6",
            "trainer.initial_policy_kl_penalty=0.05",
            "optim.lr=1e-2",
            "lora.r=4",
            f"exp.output_dir={tmp_path / out}",
            "exp.progress=false",
            "exp.tensorboard=false",
            *overrides,
        ],
    )


def test_a_lora_actor_keeps_no_second_copy_and_trains_its_adapters_only(tmp_path):
    run = prepare_ppo_run(_cfg(tmp_path, "run", "trainer.max_steps=2", "lora.merge_on_save=true"))
    actor = run.actor
    assert is_peft_model(actor.model)
    assert actor.init_policy is actor.model  # the initial policy: the same weights, adapters disabled
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    assert [p for g in run.optim.optimizer.param_groups for p in g["params"]] == trainable
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    actor.set_sampling(run.cfg.trainer.sampling_params(actor.eos_ids))  # as the trainer will
    tokens, scored = torch.tensor([[2, 40, 41, 42, 43, 44, 45]]), {"prompt_lengths": torch.tensor([3])}
    init_before = actor.get_init_policy_logprobs(tokens, **scored)
    assert torch.equal(actor.get_inference_log_probs(tokens, **scored), init_before)  # B = 0: KL starts at 0

    run_ppo(run, TargetTokenScorer())
    after = actor.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    # with its adapters disabled the trained actor still is the initial policy
    assert torch.equal(actor.get_init_policy_logprobs(tokens, **scored), init_before)
    assert not torch.allclose(actor.get_inference_log_probs(tokens, **scored), init_before)
    out = run.output_dir / "actor"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(
            merged(tokens).logits, actor.model(input_ids=tokens).logits, rtol=1e-5, atol=1e-5
        )


def test_a_lora_actor_resumes_from_its_adapter_checkpoint_as_if_never_stopped(tmp_path):
    straight = prepare_ppo_run(_cfg(tmp_path, "a", "trainer.max_steps=2"))
    run_ppo(straight, TargetTokenScorer())
    run_ppo(prepare_ppo_run(_cfg(tmp_path, "b", "trainer.max_steps=1")), TargetTokenScorer())
    assert (tmp_path / "b" / "checkpoints" / "step_1" / "actor" / "adapter_config.json").is_file()
    resumed = prepare_ppo_run(_cfg(tmp_path, "b", "trainer.max_steps=2"))
    run_ppo(resumed, TargetTokenScorer())
    want = straight.actor.model.state_dict()
    for k, v in resumed.actor.model.state_dict().items():
        assert torch.equal(v, want[k]), k
    metrics = [
        json.loads(line) for line in (tmp_path / "a" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    again = [
        json.loads(line) for line in (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    drop = ("timing/",)
    assert [{k: v for k, v in m.items() if not k.startswith(drop)} for m in again] == [
        {k: v for k, v in m.items() if not k.startswith(drop)} for m in metrics
    ]


def test_every_rank_starts_from_the_same_adapters(tmp_path, monkeypatch):
    """Replicas must start equal: LoRA's initial A matrices are random, so every rank draws them
    from the run's seed (each rank used to draw from seed + rank, so 2 ddp replicas trained two
    different models from the first step). Ranks 0 and 1 of a 2-rank run, built in one process."""
    from openaligner import distributed as dp

    adapters = []
    for rank in (0, 1):
        monkeypatch.setattr(dp, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(dp, "world_size", lambda: 2)
        run = prepare_ppo_run(_cfg(tmp_path, f"rank{rank}", "trainer.max_steps=1"))
        adapters.append({k: v for k, v in run.actor.model.state_dict().items() if "lora_A" in k})
        # and from here on each rank draws its own stream (dropout, sampling)
        adapters[-1]["_next_draw"] = torch.rand(3)
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) > 1
    for key in adapters[0]:
        if key != "_next_draw":
            assert torch.equal(adapters[0][key], adapters[1][key]), key
    assert not torch.equal(adapters[0]["_next_draw"], adapters[1]["_next_draw"])


def test_a_rerun_that_resumes_at_its_last_step_keeps_the_logs_and_says_nothing_ran(tmp_path):
    """A run whose newest checkpoint is step 2 but whose logs go on to step 3 (it died before step
    3's checkpoint), rerun with trainer.max_steps=2 to export step 2's actor: no step runs, so the
    logs of step 3 stay (they were dropped: "rewinds 480 log records"), and the closing line says
    that nothing ran instead of printing an empty summary ("steps 24 → 24; ; actor saved")."""
    import shutil

    from openaligner.cli.train_ppo import closing_line

    first = prepare_ppo_run(_cfg(tmp_path, "r", "trainer.max_steps=3", "exp.keep_last=0"))
    run_ppo(first, TargetTokenScorer())
    logs = tmp_path / "r" / "logs"
    before = {name: (logs / name).read_text() for name in ("metrics.jsonl", "rollouts.jsonl")}
    assert '"step": 3' in before["metrics.jsonl"]
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "step_3")
    started = []
    run_ppo(prepare_ppo_run(_cfg(tmp_path, "r", "trainer.max_steps=2")), TargetTokenScorer(), started.append)
    assert {name: (logs / name).read_text() for name in before} == before
    line = closing_line("gae", started[0], tmp_path / "r" / "actor")
    assert line == (
        "train-ppo: PPO, step 2: no step left to run (the checkpoint it resumed from is at the run's "
        f"last step); actor saved to {tmp_path / 'r' / 'actor'}"
    )
    assert (tmp_path / "r" / "actor" / "adapter_config.json").is_file()
