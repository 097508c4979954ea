"""Critic server throughput: critic_infer under concurrent clients and critic_train, against offline.

Workload (/work/shared/bench/workload.md): the canonical GPT-2 critic and reward model (n_layer=4,
n_embd=256, n_head=4, vocab 512, n_positions=256, scalar head), random init with seed 0, fp32,
``torch.set_num_threads(--threads)`` in the server and here; sequences of 96 token ids from 3..511
(seed 0): 32 prompt + 64 response tokens, as one PPO rollout row.

The server (:class:`CriticServerTrainer`, combined mode: values *and* rewards per request, a real
Triton over HTTP) runs in a child process. Inference: closed-loop clients (one
``tritonclient.http`` connection per thread) at 1, 8 and 32 concurrent clients for ``--seconds``
after a 1 s warm-up, each request holding ``--rows-per-request`` sequences; the limit is an
offline ``CriticModel.infer`` + ``RewardModel.infer`` over all 128 sequences in micro-batches of
the server's forward size (and in one full batch), re-measured before each level. Training:
``--train-requests`` requests of 64 rows (one global batch, the workload's train batch; mask over
the 64 response positions) sent one after another through ``RemoteGPTRMCriticClient.train``,
after one warm-up request; the limit is the same math offline — the same micro-batches of
forward/backward, gradient clipping and one AdamW step per 64 rows — in this process without
Triton, timed alternately with the requests so that the shared machine's load drift hits both.
Also reported: ``critic_save`` latency, start-up and shutdown times.

Prints one JSON object. Usage:
``python benchmarks/bench_critic_server.py [--seconds 5] [--rows-per-request 1 8] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from bench_reward_server import (
    ChildServer,
    against_offline,
    free_port,
    serve_until_stopped,
    server_settings,
    triton_load,
    versions,
)

SEQ_TOKENS = 96
PROMPT_TOKENS = 32
POOL = 128
TRAIN_ROWS = 64
CONCURRENCY = (1, 8, 32)


def sequences() -> torch.Tensor:
    """The fixed pool of [POOL, 96] token ids (seed 0)."""
    return torch.randint(3, 512, (POOL, SEQ_TOKENS), generator=torch.Generator().manual_seed(0))


def build_models() -> tuple[Any, Any]:
    from openaligner.models.builders import WORKLOAD_SIZE, build_tiny_critic, build_tiny_reward_model

    return build_tiny_critic("gpt2", WORKLOAD_SIZE, seed=0), build_tiny_reward_model(
        "gpt2", WORKLOAD_SIZE, seed=0
    )


def train_batch(pool: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """64 rows with returns near the values' scale, prev_values 0 and the response positions masked in."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(POOL, generator=g)[:TRAIN_ROWS]
    mask = torch.zeros(TRAIN_ROWS, SEQ_TOKENS - 1)
    mask[:, PROMPT_TOKENS - 1 :] = 1.0  # [prompt_len - 1, response_len - 1), as the PPO trainer builds it
    return {
        "response_tokens": pool[rows],
        "returns": torch.randn(TRAIN_ROWS, SEQ_TOKENS - 1, generator=g) * 0.5,
        "values": torch.zeros(TRAIN_ROWS, SEQ_TOKENS - 1),
        "mask": mask,
    }


def serve(conn: Connection, port: int, threads: int, settings: dict[str, Any]) -> None:
    """Child process: build the models, serve them, answer 'stats' and 'stop' over ``conn``."""
    os.dup2(2, 1)  # tritonserver inherits stdout and prints to it; keep the parent's JSON clean
    torch.set_num_threads(threads)
    from openaligner.io.checkpoint import CheckpointManager
    from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
    from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

    critic, reward_model = build_models()
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-5)
    cfg = CriticServerConfig(
        port=port,
        inference_micro_batch_size=settings["inference_micro_batch_size"],
        model_forward_micro_batch_size=settings["model_forward_micro_batch_size"],
        max_queue_delay_microseconds=settings["max_queue_delay_microseconds"],
        max_batch_size=settings["max_batch_size"],
        batch_invariant=settings.get("batch_invariant", False),
        max_sequence_length=256,
    )
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=TRAIN_ROWS, micro_batch_size=settings["train_micro_batch_size"]),
        critic,
        optimizer,
        checkpoints=CheckpointManager(tempfile.mkdtemp(prefix="bench-critic-")),
        batch_invariant_multiple=cfg.fixed_width_multiple(),
    )
    server = CriticServerTrainer(
        cfg,
        trainer,
        None,
        reward_model=reward_model,
    )
    stats = server.infer_endpoint.stats
    serve_until_stopped(conn, server, lambda: {"calls": stats.calls, "rows": stats.rows})


def offline_infer_sequences_per_s(critic: Any, rm: Any, tokens: torch.Tensor, mbs: int | None) -> float:
    lengths = torch.full((tokens.shape[0],), SEQ_TOKENS)
    critic.infer(tokens[:8], lengths[:8])  # warm-up
    times = []
    for _ in range(3):
        started = time.perf_counter()
        critic.infer(tokens, lengths, micro_batch_size=mbs)
        rm.infer(tokens, lengths, micro_batch_size=mbs)
        times.append(time.perf_counter() - started)
    return tokens.shape[0] / statistics.median(times)


class OfflineTrainer:
    """The server's training math in this process, without Triton: micro-batched backward,
    gradient clipping and one AdamW step per 64 rows."""

    def __init__(self, mbs: int) -> None:
        self.critic, _ = build_models()
        self.optimizer = torch.optim.AdamW(self.critic.parameters(), lr=1e-5)
        self.mbs = mbs

    def step(self, data: dict[str, torch.Tensor]) -> None:
        from openaligner.algorithms import value_loss

        self.optimizer.zero_grad()
        total = data["mask"].sum()
        for j in range(0, TRAIN_ROWS, self.mbs):
            mask = data["mask"][j : j + self.mbs]
            values = self.critic(data["response_tokens"][j : j + self.mbs])[:, :-1]
            prev, returns = data["values"][j : j + self.mbs], data["returns"][j : j + self.mbs]
            loss, _ = value_loss(values, prev, returns, mask, 0.2)
            (loss * mask.sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(list(self.critic.parameters()), 1.0)
        self.optimizer.step()


def load(port: int, concurrency: int, rows: int, seconds: float, pool: np.ndarray) -> dict[str, Any]:
    """Closed-loop clients on critic_infer; latencies of requests that started after the warm-up."""
    outputs = {"values": (-1, SEQ_TOKENS), "rewards": (-1, 1)}
    return triton_load(port, "critic_infer", outputs, concurrency, rows, seconds, pool)


def train_interleaved(port: int, pool: torch.Tensor, requests: int, mbs: int) -> dict[str, Any]:
    """critic_train over HTTP and the same step offline, alternating, so load drift hits both."""
    from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient

    cfg = RemoteCriticConfig(critic=CriticAddress(port=port), init_timeout_s=60, request_timeout_s=600)
    offline = OfflineTrainer(mbs)
    http_s, offline_s, losses = [], [], []
    with RemoteGPTRMCriticClient(cfg) as client:
        for i in range(requests + 1):  # the first of each is a warm-up
            data = train_batch(pool, seed=i)
            started = time.perf_counter()
            result = client.train(data).result()
            took = time.perf_counter() - started
            started = time.perf_counter()
            offline.step(data)
            took_offline = time.perf_counter() - started
            if i > 0:
                http_s.append(took)
                offline_s.append(took_offline)
                losses.append(result["loss"])
        save_started = time.perf_counter()
        saved = client.save().result()
        save_s = time.perf_counter() - save_started
    median, median_offline = statistics.median(http_s), statistics.median(offline_s)
    return {
        "requests": requests,
        "rows_per_request": TRAIN_ROWS,
        "request_s_median": median,
        "samples_per_s": TRAIN_ROWS / median,
        "offline_step_s_median": median_offline,
        "offline_samples_per_s": TRAIN_ROWS / median_offline,
        "ratio_to_offline": median_offline / median,
        "losses": losses,
        "save_s": save_s,
        "saved_step": saved["step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--seconds", type=float, default=5.0, help="measured seconds per inference load level")
    add("--rows-per-request", type=int, nargs="+", default=[1, 8], help="sequences per infer request")
    add("--train-requests", type=int, default=5, help="measured critic_train requests (after 1 warm-up)")
    add("--threads", type=int, default=2, help="torch threads, here and in the server")
    add("--forward-micro-batch", type=int, default=32, help="server model_forward_micro_batch_size")
    add("--train-micro-batch", type=int, default=16, help="server training micro_batch_size")
    add("--preferred", type=int, nargs="+", default=[32], help="server inference_micro_batch_size")
    add("--queue-delay-us", type=int, default=2000, help="server max_queue_delay_microseconds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    pool = sequences()
    critic, rm = build_models()
    settings = {**server_settings(args), "train_micro_batch_size": args.train_micro_batch}
    port = free_port()
    server = ChildServer(serve, port, args.threads, settings)

    levels = []
    try:
        for rows in args.rows_per_request:
            for concurrency in CONCURRENCY:
                offline_mbs = offline_infer_sequences_per_s(critic, rm, pool, args.forward_micro_batch)
                offline_full = offline_infer_sequences_per_s(critic, rm, pool, None)
                before = server.stats()
                result = load(port, concurrency, rows, args.seconds, pool.numpy())
                after = server.stats()
                against_offline(result, before, after, offline_full, offline_mbs)
                levels.append(result)
        train = train_interleaved(port, pool, args.train_requests, args.train_micro_batch)
    finally:
        stop_s = server.stop()

    print(
        json.dumps(
            {
                "benchmark": "critic_server",
                "workload": "GPT-2 n_layer=4 n_embd=256 n_head=4 vocab=512, scalar heads; 96-token sequences",
                "mode": "combined (values + rewards per infer request)",
                "threads": args.threads,
                "server": settings,
                "infer_levels": levels,
                "train": train,
                "startup_s": server.start_s,
                "process_ready_s": server.ready_s,
                "shutdown_s": stop_s,
                "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
                "versions": versions(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
