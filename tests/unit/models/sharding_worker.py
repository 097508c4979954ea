"""One training step of the same tiny Llama held four ways on each of 2 ranks: replicas, shards,
shards in CPU memory (offload), shards with activation checkpointing. Writes each rank's losses,
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
from openaligner.models.sharding import ParallelConfig, full_state_dict, shard, training_state_bytes
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


def main(prefix: str) -> None:
    torch.set_num_threads(1)
    dp.init_from_env()
    out = {name: one_way(parallel) for name, parallel in WAYS.items()}
    Path(f"{prefix}.rank{dp.rank()}").write_text(json.dumps(out))
    dp.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
