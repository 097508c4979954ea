"""One training step of the same tiny Llama held four ways on each of 2 ranks: replicas, shards,
shards in CPU memory (offload), shards with activation checkpointing; and saved models read by rank
0 alone, the other rank receiving its shards (``loaded_from_rank0``). Writes each rank's losses,
gradient norms, the weights after the step (summed per tensor) and what its parameters, gradients
and AdamW state occupy, as JSON: ``torchrun --nproc_per_node 2 sharding_worker.py OUT_PREFIX``
(writes ``OUT_PREFIX.rank<r>``). Used by test_sharding.py."""

import json
import os
import sys
from pathlib import Path

import torch

from openaligner import distributed as dp
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.sharding import (
    ActorParallelConfig,
    ParallelConfig,
    full_state_dict,
    shard,
    training_state_bytes,
)
from openaligner.trainer.optim_step import optimizer_step

ARCH = os.environ.get("ARCH", "llama")
SIZE = TinySize(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4)
WAYS = {
    "ddp": ParallelConfig(strategy="ddp"),
    "fsdp": ParallelConfig(strategy="fsdp"),
    "fsdp_offload": ParallelConfig(strategy="fsdp", offload=True),
    "fsdp_checkpointing": ParallelConfig(strategy="fsdp", activation_checkpointing=True),
}


def one_way(parallel: ParallelConfig) -> dict:
    model = shard(build_tiny_causal_lm(ARCH, SIZE, seed=0), parallel)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(7)
    tokens = dp.local_rows(torch.randint(3, SIZE.vocab_size, (4, 24), generator=g))
    losses, norms = [], []
    for _ in range(3):  # three steps: each runs on weights the one before moved
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        outcome = optimizer_step(
            params,
            optimizer,
            None,
            torch.amp.GradScaler("cpu", enabled=False),
            max_grad_norm=1.0,
            gradients="mean",
        )
        losses.append(float(dp.all_reduce_sum(loss.detach()) / dp.world_size()))
        norms.append(outcome.grad_norm)
        with torch.no_grad():  # a scoring forward between steps (PPO's log-probs) must not leave
            model(input_ids=tokens)  # the next step's forward stale weights
    memory = training_state_bytes(params, optimizer)  # gradients of the last step still held
    state = full_state_dict(model)
    weights = {k: float(v.double().sum()) for k, v in state.items()} if state is not None else {}
    return {"losses": losses, "grad_norms": norms, "memory": memory, "weights": weights}


def loaded_from_rank0(directory: Path) -> dict:
    """Rank 0 reads saved models (a tied GPT-2 causal LM, a Llama reward model), the other rank
    builds skeletons and receives its shards: every rank's logits / rewards equal the saved models'.
    The causal LM's PPO initial policy is sharded from a copy without weights on every rank (rank 0
    included) and gives the same logits."""
    from openaligner.models.sharding import builds_skeleton, fill_from_leader, state_to_share
    from openaligner.models.source import ModelSourceConfig, load_causal_lm, load_reward_model
    from openaligner.trainer import ppo_recipe

    parallel = ParallelConfig(strategy="fsdp")
    tokens = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([10, 6])
    result = {"skeleton": builds_skeleton(parallel)}
    lm = load_causal_lm(
        ModelSourceConfig(path=str(directory / "lm")),
        0,
        torch.device("cpu"),
        skeleton=builds_skeleton(parallel),
    )
    result["lm_on_meta"] = next(lm.parameters()).device.type == "meta"
    state = state_to_share(lm, parallel)
    # the PPO initial policy, as train-ppo builds it: never whole on any rank before it is sharded
    seen = []

    def recording_shard(model, cfg, **kwargs):
        seen.append(all(p.is_meta for p in model.parameters()))
        return shard(model, cfg, **kwargs)

    ppo_recipe.shard = recording_shard
    init = ppo_recipe.build_init_policy(lm, ActorParallelConfig(strategy="fsdp"), state)
    ppo_recipe.shard = shard
    result["init_policy_on_meta_when_sharded"] = seen == [True]
    lm = shard(lm, parallel)
    fill_from_leader(lm, state, parallel, offload=False)
    plain = load_causal_lm(ModelSourceConfig(path=str(directory / "lm")), 0, torch.device("cpu"))
    with torch.no_grad():
        result["lm_equal"] = torch.equal(lm(input_ids=tokens).logits, plain(input_ids=tokens).logits)
        result["init_equal"] = torch.equal(init(input_ids=tokens).logits, plain(input_ids=tokens).logits)
    rm_src = ModelSourceConfig(path=str(directory / "rm"))
    rm = load_reward_model(rm_src, 0, torch.device("cpu"), skeleton=builds_skeleton(parallel))
    state = state_to_share(rm, parallel)
    rm = shard(rm, parallel)
    fill_from_leader(rm, state, parallel, offload=False)
    plain_rm = load_reward_model(rm_src, 0, torch.device("cpu"))
    with torch.no_grad():
        result["rm_diff"] = (rm.infer(tokens, lengths) - plain_rm.infer(tokens, lengths)).abs().max().item()
    return result


def main(prefix: str) -> None:
    torch.set_num_threads(1)
    dp.init_from_env()
    out = {name: one_way(parallel) for name, parallel in WAYS.items()}
    if dp.is_leader():
        build_tiny_causal_lm("gpt2", TinySize(num_layers=2), seed=5).save_pretrained(f"{prefix}.models/lm")
        from openaligner.models.builders import build_tiny_reward_model

        build_tiny_reward_model("llama", TinySize(num_layers=2), seed=6).save_pretrained(
            f"{prefix}.models/rm"
        )
    dp.barrier()
    out["loaded_from_rank0"] = loaded_from_rank0(Path(f"{prefix}.models"))
    Path(f"{prefix}.rank{dp.rank()}").write_text(json.dumps(out))
    dp.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.exit(dp.finish(0))  # a rank skips interpreter teardown (distributed.finish says why)
