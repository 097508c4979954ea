"""Checkpoints and exports of models sharded over 2 ranks (torchrun, gloo), for test_sharded_files.py:
``torchrun --nproc_per_node 2 sharded_files_worker.py OUT``.

Trains a tiny gpt2 (tied head: the trickiest export) one AdamW step on rank-specific rows, then
every rank takes part in: a sharded checkpoint (``OUT/checkpoints/step_1``) and one that fails on
rank 1 (step 2); exports in float32
and bfloat16 with a small ``max_shard_size`` (``OUT/export_fp32``, ``OUT/export_bf16``); a LoRA
model's checkpoint (``OUT/lora_checkpoints/step_1``), adapter and merged exports (``OUT/adapter``,
``OUT/merged``); a sharded critic's checkpoint (``OUT/critic/step_1``), the same written with
the critic's keys of old (``hf_model.``-prefixed, ``OUT/critic_old/step_1``) and its export
(``OUT/critic_export``); reloading both checkpoints into fresh sharded models; and a refused
resume from a checkpoint of a model that was not sharded. Rank 0 writes what the test compares
against to ``OUT/rank0.pt``: the gathered weights and optimizer state, and what each reload and
refusal did.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from openaligner import distributed as dp
from openaligner.io.checkpoint import CheckpointManager, rng_state
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm, build_tiny_critic
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.models.precision import save_pretrained_as
from openaligner.models.sharding import ParallelConfig, full_state_dict, shard
from openaligner.trainer.checkpoint_files import TrainingFiles, save_collective, save_sharded_state
from openaligner.trainer.critic import CRITIC_FILES, CriticTrainConfig, CriticTrainer

FILES = TrainingFiles(model_dir="model", state_file="state.json")
SIZE = TinySize(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2)
FSDP = ParallelConfig(strategy="fsdp")


def trained(model, lr=0.05):
    """``model`` after one AdamW step (and one LR-schedule step) on this rank's rows."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    x = (torch.arange(12).reshape(2, 6) * (dp.rank() + 2)) % 32
    model(x, labels=x).loss.backward()
    opt.step()
    scheduler.step()
    opt.zero_grad(set_to_none=True)
    return opt, scheduler


def reloaded_equal(directory, fresh, expected):
    """Whether ``fresh`` (sharded) holds ``expected`` (rank 0's gathered weights) after reading
    ``directory``; a collective."""
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.05)
    FILES.read(directory, fresh, opt, None, torch.device("cpu"))
    state = full_state_dict(fresh)
    if not dp.is_leader():
        return None
    return all(torch.equal(state[k], v) for k, v in expected.items())


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dp.init_from_env()
    report = {}
    # 1. a sharded checkpoint: every rank writes its shards, rank 0 the rest and publishes
    model = shard(build_tiny_causal_lm("gpt2", SIZE, seed=0), FSDP)
    opt, scheduler = trained(model)

    def write(d: Path) -> None:
        FILES.write(d, model, opt, scheduler, dp.gather_objects(rng_state()))
        if dp.is_leader():
            FILES.write_state(d, {"step": 1})

    report["published"] = str(save_collective(CheckpointManager(out / "checkpoints"), 1, write))

    def fail_on_rank_1(d: Path) -> None:
        write(d)
        if dp.rank() == 1:
            raise OSError("No space left on device (simulated)")

    try:
        save_collective(CheckpointManager(out / "checkpoints"), 2, fail_on_rank_1)
        report["failures"] = dp.gather_objects(None)
    except dp.CollectiveFailure as e:
        report["failures"] = dp.gather_objects(str(e))
    report["weights"] = full_state_dict(model)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    report["optimizer"] = get_optimizer_state_dict(model, opt, options=full)
    # 2. exports: gathered to rank 0, in the save dtype, several files and an index
    save_pretrained_as(model, out / "export_fp32", max_shard_size="20KB")
    save_pretrained_as(model, out / "export_bf16", torch.bfloat16, max_shard_size="20KB")
    # 3. LoRA: the adapter directory and the merged model, through the actor as train-ppo writes them
    lora = shard(add_lora(build_tiny_causal_lm("gpt2", SIZE, seed=0), LoraConfig(r=4)), FSDP)
    lora_opt, _ = trained(lora, lr=0.1)
    lora_files = TrainingFiles(model_dir="adapter", state_file="state.json")

    def write_lora(d: Path) -> None:
        lora_files.write(d, lora, lora_opt, None)
        if dp.is_leader():
            lora_files.write_state(d, {"step": 1})

    save_collective(CheckpointManager(out / "lora_checkpoints"), 1, write_lora)
    actor = CausalLMActor(lora, init_policy=False)
    actor.save_pretrained(out / "adapter")
    actor.save_merged(out / "merged")
    report["lora"] = full_state_dict(lora)
    # 4. the critic's checkpoint, written by every rank (as serve-critic does when sharded)
    critic = shard(build_tiny_critic("gpt2", SIZE, seed=0), FSDP)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=0.05)
    critic(torch.arange(6).reshape(1, 6) + dp.rank()).square().mean().backward()
    critic_opt.step()
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=2),
        critic,
        critic_opt,
        checkpoints=CheckpointManager(out / "critic"),
    )
    trainer.step = 1
    trainer.write_checkpoint()
    report["critic"] = full_state_dict(critic)
    critic.save_pretrained(out / "critic_export")  # a collective, as train-rm's export would be

    def write_old_critic(d: Path) -> None:  # as critic checkpoints were written: the wrapper's keys
        save_sharded_state(d / CRITIC_FILES.sharded_dir, critic, critic_opt)
        if dp.is_leader():
            CRITIC_FILES.write_state(d, {"step": 1})

    save_collective(CheckpointManager(out / "critic_old"), 1, write_old_critic)
    fresh_critic = shard(build_tiny_critic("gpt2", SIZE, seed=1), FSDP)
    fresh_trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=2),
        fresh_critic,
        torch.optim.AdamW(fresh_critic.parameters(), lr=0.05),
        checkpoints=CheckpointManager(out / "critic"),
    )
    fresh_trainer.resume()
    restored = full_state_dict(fresh_critic)
    if dp.is_leader():
        report["critic_restored"] = fresh_trainer.step == 1 and all(
            torch.equal(restored[k], v) for k, v in report["critic"].items()
        )
    # 5. the same number of ranks reads the checkpoint back exactly
    report["reloaded"] = reloaded_equal(
        Path(report["published"]), shard(build_tiny_causal_lm("gpt2", SIZE, seed=1), FSDP), report["weights"]
    )
    # 6. a checkpoint of a model that was not sharded: refused, on every rank, naming the fix
    whole = out / "whole"
    if dp.is_leader():
        plain = build_tiny_causal_lm("gpt2", SIZE, seed=0)
        whole.mkdir()
        FILES.write(whole, plain, torch.optim.AdamW(plain.parameters()), None)
        FILES.write_state(whole, {"step": 1})
    dp.barrier()
    try:
        FILES.read(whole, model, opt, scheduler, torch.device("cpu"))
        refusals = dp.gather_objects(None)
    except ValueError as e:
        refusals = dp.gather_objects(str(e))
    report["refusals"] = refusals
    if dp.is_leader():
        torch.save(report, out / "rank0.pt")
    dp.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.exit(dp.finish(0))  # a rank skips interpreter teardown (distributed.finish says why)
