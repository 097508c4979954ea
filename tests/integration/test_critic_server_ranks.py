"""Two gloo ranks serve the critic (rank 0 runs Triton, rank 1 follows FORWARD/TRAIN/SAVE/RESTORE/STOP)
and answer like one in-process rank: the same values and rewards, the same training results; a
restore_step sends both ranks back."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from procs import free_port

from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient
from openaligner.io.checkpoint import CheckpointManager
from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel
from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

pytestmark = pytest.mark.slow

SIZE = TinySize(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4)  # the shared tiny fixture's size
GBS = 4


def build(port: int, micro_batch_size: int, ckpt_dir: str | None) -> CriticServerTrainer:
    hf = build_tiny_sequence_classifier("gpt2", SIZE, seed=0)
    critic = CriticModel(hf).eval()
    reward_model = RewardModel(build_tiny_sequence_classifier("gpt2", SIZE, seed=0))
    cfg = CriticServerConfig(
        port=port, inference_micro_batch_size=[2], model_forward_micro_batch_size=2, heartbeat_s=5.0
    )
    # plain SGD: the comparison sees gradient differences at their own size (Adam's first step is ~sign)
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.05)
    checkpoints = CheckpointManager(ckpt_dir) if ckpt_dir else None
    train_cfg = CriticTrainConfig(global_batch_size=GBS, micro_batch_size=micro_batch_size)
    trainer = CriticTrainer(train_cfg, critic, optimizer, checkpoints=checkpoints)
    return CriticServerTrainer(cfg, trainer, None, reward_model=reward_model)


def rank_main(rank: int, dist_port: int, http_port: int, ckpt_dir: str, ready, stop) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{dist_port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        server = build(http_port, micro_batch_size=1, ckpt_dir=ckpt_dir)
        if rank == 0:
            server.start()
            ready.set()
            stop.wait(timeout=120)
            server.stop()
        else:
            server.run_server()  # follows rank 0 until STOP
    finally:
        dist.destroy_process_group()


def rollout(seed: int, rows: int, width: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "response_tokens": torch.randint(3, 100, (rows, width), generator=g),
        "response_lengths": torch.randint(2, width + 1, (rows,), generator=g),
    }


def train_data(batch, values, target):
    mask = (torch.arange(values.shape[1])[None, :] < (batch["response_lengths"] - 1)[:, None]).float()
    return {"response_tokens": batch["response_tokens"], "returns": torch.full_like(values, target),
            "values": values, "mask": mask}  # fmt: skip


def one_rank_answers(batch, target):
    """The same calls on a world of one, in this process, without HTTP, each global batch of 4 rows
    in one micro-batch (the 2 ranks run 2 micro-batches of 1 row each)."""
    server = build(free_port(), micro_batch_size=GBS, ckpt_dir=None)
    tokens, lengths = batch["response_tokens"].numpy(), batch["response_lengths"].numpy().reshape(-1, 1)
    first = server.run_inference(tokens=tokens, sequence_lengths=lengths)
    values = torch.from_numpy(first["values"])[:, :-1]
    data = train_data(batch, values, target)
    trained = server.run_training(
        tokens=tokens, returns=data["returns"].numpy(), prev_values=values.numpy(), mask=data["mask"].numpy()
    )
    second = server.run_inference(tokens=tokens, sequence_lengths=lengths)
    return first, trained, second


@pytest.mark.timeout(180)
def test_two_ranks_answer_and_train_like_one(tmp_path):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    http_port = free_port()
    procs = mp.spawn(
        rank_main, args=(free_port(), http_port, str(tmp_path), ready, stop), nprocs=2, join=False
    )
    batch = rollout(0, 7)  # 7 rows: padded to whole shares of 2 ranks, and to 2 global batches of 4
    try:
        want_first, want_trained, want_second = one_rank_answers(batch, target=0.3)
        assert ready.wait(timeout=120), "rank 0 never started serving"
        cfg = RemoteCriticConfig(pad_to_length=24, critic=CriticAddress(port=http_port), init_timeout_s=20)
        with RemoteGPTRMCriticClient(cfg) as client:
            rewards, values = client.infer_rm_critic(batch).result()
            trained = client.train(train_data(batch, values, target=0.3)).result()
            rewards2, values2 = client.infer_rm_critic(batch).result()
            saved = client.save().result()
            client.train(train_data(batch, values2, target=-0.5)).result()  # on to step 4
            restored = client.restore(2).result()
            _, values3 = client.infer_rm_critic(batch).result()
    finally:
        stop.set()
        deadline = time.monotonic() + 60
        try:
            joined = False  # join() returns after each exiting rank; True once all have
            while not joined and time.monotonic() < deadline:
                joined = procs.join(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            for proc in procs.processes:  # never leave a rank (and its Triton) behind
                if proc.is_alive():
                    proc.kill()
    assert joined, "the ranks did not exit after STOP"
    torch.testing.assert_close(
        rewards, torch.from_numpy(want_first["rewards"]).reshape(-1), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(values, torch.from_numpy(want_first["values"])[:, :-1], atol=1e-5, rtol=1e-5)
    assert trained["critic_step"] == float(want_trained["step"][0]) == 2
    # 2 ranks × 2 micro-batches of 1 row = 1 rank × 1 micro-batch of 4 (rows of 1 to 15 valid
    # positions): the value loss is a token mean over each whole global batch. The loss and
    # gradient norm are float32 sums of ≤ 4 shares in another order (≤ 4 × 2⁻²⁴ ≈ 2.4e-7
    # relative) over forwards of other batch shapes (a few ulps): rel 1e-6.
    assert trained["loss"] == pytest.approx(float(want_trained["loss_mean"][0]), rel=1e-6)
    assert trained["grad_norm"] == pytest.approx(float(want_trained["grad_norm"][0]), rel=1e-6)
    assert trained["clip_fraction"] == pytest.approx(float(want_trained["clip_fraction"][0]), abs=1e-6)
    torch.testing.assert_close(values2, torch.from_numpy(want_second["values"])[:, :-1], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(values2, values)
    torch.testing.assert_close(rewards2, rewards, atol=0, rtol=0)
    assert saved["step"] == 2 and (tmp_path / "step_2" / "critic" / "model.safetensors").is_file()
    # each rank computes a share of the rows: equal values mean both went back to step 2
    assert restored == {"status": 0, "step": 2}
    torch.testing.assert_close(values3, values2, atol=0, rtol=0)
