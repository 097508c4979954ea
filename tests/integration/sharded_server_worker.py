"""One rank of a critic server and of a reward server, driven in-process (no Triton, no HTTP).

Used by test_sharded_servers.py: ``python sharded_server_worker.py OUT`` (one process) or
``torchrun --nproc_per_node 2 sharded_server_worker.py OUT``; ``STRATEGY`` (ddp | fsdp) in the
environment lays the models over the ranks (``parallel.strategy``), ``MICRO_BATCH`` is the critic's
``train.micro_batch_size`` (default 1; global batches of 4 rows). Rank 0 leads with a
:class:`Rank0Dispatcher` as ``start()`` would, minus Triton, and sends the requests through the
servers' own entry points (validation first, then every rank's opcode); the other ranks follow in
``run_server()``. Rank 0 writes OUT (``torch.save``): the critic's answers before and after three
``critic_train`` calls, their results, the critic's whole weights afterwards, a checkpoint's
round trip (``critic_save``, train, restore, the same training again; a new server resuming from
it), the reward server's rewards, and the messages of the requests refused. Checkpoints go to
``OUT.ckpt/``.
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from openaligner import distributed as dp
from openaligner.io.checkpoint import CheckpointManager
from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.critic import CriticModel
from openaligner.models.precision import Precision
from openaligner.models.reward import RewardModel
from openaligner.models.sharding import ParallelConfig, full_state_dict, is_sharded, shard
from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
from openaligner.servers.distributed import Rank0Dispatcher
from openaligner.servers.reward import RewardModelServer, RewardServerConfig
from openaligner.servers.validation import RequestError
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

SIZE = TinySize(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4)  # the shared tiny fixture's size
TRAIN_ROWS = (7, 5, 3)  # padded to 8, 8, 4 rows (global batch 4); with 2 ranks, rank 1's share of
# the second call's second step is padding only, and its second micro-batch of the third call too


def rollout(seed: int, rows: int, width: int = 16) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 100, (rows, width), generator=g)
    lengths = torch.randint(2, width + 1, (rows, 1), generator=g)
    return tokens.numpy(), lengths.numpy()


def train_inputs(tokens: np.ndarray, lengths: np.ndarray, values: np.ndarray, target: float) -> dict:
    aligned = values[:, :-1]
    mask = (np.arange(aligned.shape[1])[None, :] < lengths - 1).astype(np.float32)
    returns = (target + 0.05 * np.arange(aligned.shape[1]) * np.ones_like(aligned)).astype(np.float32)
    return {"tokens": tokens, "returns": returns, "prev_values": aligned, "mask": mask}


def lead(server: CriticServerTrainer | RewardModelServer) -> None:
    """Rank 0 leads the other ranks as ``start()`` does, without starting Triton."""
    server._dispatcher = Rank0Dispatcher(server.handlers(), heartbeat_s=None)


def critic_server(parallel: ParallelConfig, checkpoints: Path, resume: bool = False) -> CriticServerTrainer:
    critic = shard(CriticModel(build_tiny_sequence_classifier("gpt2", SIZE, seed=0)).eval(), parallel)
    reward_model = RewardModel(build_tiny_sequence_classifier("gpt2", SIZE, seed=1)).requires_grad_(False)
    reward_model = shard(reward_model.eval(), parallel)
    # SGD with momentum: optimizer state (sharded too) without Adam's sign-like first steps, so
    # the comparison sees gradient differences at their own size
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.05, momentum=0.9)
    micro_batch_size = int(os.environ.get("MICRO_BATCH", "1"))
    train_cfg = CriticTrainConfig(global_batch_size=4, micro_batch_size=micro_batch_size)
    trainer = CriticTrainer(train_cfg, critic, optimizer, checkpoints=CheckpointManager(checkpoints))
    cfg = CriticServerConfig(inference_micro_batch_size=[2], model_forward_micro_batch_size=2)
    return CriticServerTrainer(cfg, trainer, None, reward_model=reward_model, resume=resume)


def drive_critic(server: CriticServerTrainer) -> dict:
    tokens, lengths = rollout(0, 7)
    out: dict = {"first": server.run_inference(tokens=tokens, sequence_lengths=lengths), "trained": []}
    for call, (rows, target) in enumerate(zip(TRAIN_ROWS, (0.3, -0.5, 0.8), strict=True)):
        t, n = rollout(10 + call, rows)
        values = server.run_inference(tokens=t, sequence_lengths=n)["values"]
        out["trained"].append(server.run_training(**train_inputs(t, n, values, target)))
    refused = []
    bad = train_inputs(tokens, lengths, out["first"]["values"], 0.0)
    for inputs in ({**bad, "mask": bad["mask"] * 2}, {"tokens": tokens + 100, "sequence_lengths": lengths}):
        try:
            (server.run_training if "mask" in inputs else server.run_inference)(**inputs)
        except RequestError as e:
            refused.append(str(e))
    out["refused"] = refused
    out["second"] = server.run_inference(tokens=tokens, sequence_lengths=lengths)  # still in step
    # a checkpoint's round trip: save, train, go back, the same training again
    out["saved"] = server.save()
    again = train_inputs(tokens, lengths, out["second"]["values"], 0.1)
    out["after_save"] = server.run_training(**again)
    out["restored"] = [server.restore(out["saved"])]
    out["after_restore"] = server.run_training(**again)
    out["restored"].append(server.restore(out["saved"]))  # back once more: the weights kept are step 5's
    return out


def reward_server(parallel: ParallelConfig) -> RewardModelServer:
    """The reward model cast to bfloat16 (as serve-reward does for bf16-mixed), then sharded."""
    precision = Precision("bf16-mixed", "cpu")
    hf = nn.Module.to(build_tiny_sequence_classifier("gpt2", SIZE, seed=1), dtype=precision.inference_dtype)
    model = shard(RewardModel(hf).eval().requires_grad_(False), parallel)
    cfg = RewardServerConfig(
        inference_micro_batch_size=[2], model_forward_micro_batch_size=2, max_batch_size=64
    )
    return RewardModelServer(precision.autocast_fn(model.infer), cfg=cfg, vocab_size=SIZE.vocab_size)


def drive_rewards(server: RewardModelServer) -> dict:
    endpoint = server.endpoint
    parts = [rollout(20, 3), rollout(21, 2, width=9), rollout(22, 1)]  # one formed batch of 6 rows
    requests = [endpoint.validate({"tokens": t, "sequence_lengths": n}) for t, n in parts]
    refused = ""
    try:
        endpoint.validate({"tokens": parts[0][0], "sequence_lengths": parts[0][1] * 0})
    except RequestError as e:
        refused = str(e)
    merged = [a["rewards"] for a in endpoint.run(requests)]
    alone = [endpoint.run([r])[0]["rewards"] for r in requests]  # 3, 2 and 1 rows: padded per call
    return {"merged": merged, "alone": alone, "refused": refused}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dp.init_from_env(timeout_s=120)
    parallel = ParallelConfig(strategy=os.environ.get("STRATEGY", "ddp"))
    result: dict = {"world": dp.world_size()}

    checkpoints = Path(f"{out}.ckpt")
    server = critic_server(parallel, checkpoints)
    result["sharded"] = is_sharded(server.model)
    if dp.is_leader():
        lead(server)
        result["critic"] = drive_critic(server)
        server.stop()  # STOP releases the other ranks
    else:
        server.run_server()
    result["weights"] = full_state_dict(server.model)  # a collective when sharded (after the restore)

    resumed = critic_server(parallel, checkpoints, resume=True)  # every rank reads the latest
    if dp.is_leader():
        lead(resumed)
        tokens, lengths = rollout(0, 7)
        result["resumed"] = (resumed.step, resumed.run_inference(tokens=tokens, sequence_lengths=lengths))
        resumed.stop()
    else:
        resumed.run_server()

    rewards = reward_server(parallel)
    if dp.is_leader():
        lead(rewards)
        result["rewards"] = drive_rewards(rewards)
        rewards.stop()
    else:
        rewards.run_server()

    if dp.is_leader():
        torch.save(result, out)
    dp.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.exit(dp.finish(0))  # a rank skips interpreter teardown (distributed.finish says why)
