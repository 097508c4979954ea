"""A real Triton critic server (tiny seeded models) driven by RemoteGPTRMCriticClient and raw HTTP.

Two servers for the module: a combined one (critic + frozen reward model, token required for
train/save, checkpoints in a temporary directory) and a separate one (values only) next to a real
reward model server. Servers run in this process, so tests can compare against their models.
"""

import threading
import time

import numpy as np
import pytest
import torch
import tritonclient.http as triton_http
from procs import free_port
from tritonclient.utils import InferenceServerException

from openaligner.clients.critic import (
    CriticAddress,
    RemoteCriticConfig,
    RemoteGPTRMCriticClient,
    RewardModelAddress,
)
from openaligner.clients.errors import AuthenticationError, BadRequestError, ServerError
from openaligner.io.checkpoint import CheckpointManager, verify_checkpoint
from openaligner.protocol import TOKEN_PARAMETER
from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
from openaligner.servers.reward import RewardModelServer
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

TOKEN = "s3cret"
PAD_TO = 32
GBS = 4


def make_server(tiny, port, *, combined, checkpoints=None, token=None):
    critic = tiny.critic()
    optimizer = torch.optim.AdamW(critic.parameters(), lr=3e-3, weight_decay=0.0)
    cfg = CriticServerConfig(
        port=port,
        combine_rm_and_critic_server=combined,
        inference_micro_batch_size=[4],
        model_forward_micro_batch_size=4,
        max_queue_delay_microseconds=20_000,
        max_batch_size=64,
        max_sequence_length=tiny.size.max_positions,
        token=token,
        heartbeat_s=None,
    )
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=GBS, micro_batch_size=2),
        critic,
        optimizer,
        checkpoints=checkpoints,
    )
    return CriticServerTrainer(
        cfg,
        trainer,
        None,
        reward_model=tiny.reward_model() if combined else None,
    )


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("critic_ckpt")


@pytest.fixture(scope="module")
def combined(tiny, ckpt_dir):
    server = make_server(
        tiny, free_port(), combined=True, checkpoints=CheckpointManager(ckpt_dir), token=TOKEN
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(combined):
    cfg = RemoteCriticConfig(
        pad_to_length=PAD_TO, critic=CriticAddress(port=combined.cfg.port), token=TOKEN, init_timeout_s=10
    )
    with RemoteGPTRMCriticClient(cfg) as c:
        yield c


@pytest.fixture(scope="module")
def separate(tiny):
    rm_model = tiny.reward_model()
    rm_server = RewardModelServer(infer_fn=rm_model.infer, port=free_port(), vocab_size=tiny.size.vocab_size)
    critic_server = make_server(tiny, free_port(), combined=False)
    rm_server.start()
    try:
        critic_server.start()
        yield critic_server, rm_server
    finally:
        critic_server.stop()
        rm_server.stop()


def rollout(seed: int, rows: int, width: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "response_tokens": torch.randint(3, 100, (rows, width), generator=g),
        "response_lengths": torch.randint(2, width + 1, (rows,), generator=g),
        "prompt_lengths": torch.ones(rows, dtype=torch.long),
        "is_end": torch.ones(rows, dtype=torch.bool),
    }


def ppo_data(batch, values, target=0.7):
    lengths = batch["response_lengths"]
    mask = (torch.arange(values.shape[1])[None, :] < (lengths - 1)[:, None]).float()
    return {
        "response_tokens": batch["response_tokens"],
        "returns": torch.full_like(values, target),
        "values": values,
        "mask": mask,
    }


def offline_values(server, batch):
    with server.lock:
        return server.model.infer(batch["response_tokens"], batch["response_lengths"])[:, :-1]


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def equal_state(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def masked_error(values, data):
    return float(((values - data["returns"]).abs() * data["mask"]).sum() / data["mask"].sum())


# ---------------------------------------------------------------------------- infer
def test_combined_infer_gives_rewards_and_values_of_the_models(combined, client, tiny):
    batch = rollout(0, 5)
    rewards, values = client.infer_rm_critic(batch).result()
    assert rewards.shape == (5,) and rewards.dtype == torch.float32
    assert values.shape == (5, 19) and values.dtype == torch.float32  # S-1 of the original width, not PAD_TO
    want_r = tiny.reward_model().infer(batch["response_tokens"], batch["response_lengths"])
    torch.testing.assert_close(rewards, want_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, offline_values(combined, batch), atol=1e-5, rtol=1e-5)


def test_separate_mode_serves_values_only_and_the_client_asks_the_reward_server(separate, tiny):
    critic_server, rm_server = separate
    http = triton_http.InferenceServerClient(f"127.0.0.1:{critic_server.cfg.port}")
    try:
        tokens = triton_http.InferInput("tokens", [2, 6], "INT64")
        tokens.set_data_from_numpy(np.full((2, 6), 7, np.int64))
        lengths = triton_http.InferInput("sequence_lengths", [2, 1], "INT64")
        lengths.set_data_from_numpy(np.array([[6], [3]], np.int64))
        answer = http.infer("critic_infer", [tokens, lengths])
        assert [o["name"] for o in answer.get_response()["outputs"]] == ["values"]
        assert answer.as_numpy("values").shape == (2, 6)
    finally:
        http.close()
    cfg = RemoteCriticConfig(
        pad_to_length=PAD_TO,
        combine_rm_and_critic_server=False,
        critic=CriticAddress(port=critic_server.cfg.port),
        reward_model=RewardModelAddress(port=rm_server.cfg.port),
        init_timeout_s=10,
    )
    batch = rollout(1, 3)
    with RemoteGPTRMCriticClient(cfg) as c:
        rewards, values = c.infer_rm_critic(batch).result()
        assert rewards.shape == (3,) and values.shape == (3, 19)
        want_r = tiny.reward_model().infer(batch["response_tokens"], batch["response_lengths"])
        torch.testing.assert_close(rewards, want_r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, offline_values(critic_server, batch), atol=1e-5, rtol=1e-5)
        result = c.train(ppo_data(batch, values)).result()  # training works without a reward model too
        assert result["critic_step"] == 1.0


def test_concurrent_infer_requests_are_merged_and_answered_per_request(combined, client):
    batches = [rollout(10 + i, rows) for i, rows in enumerate([1, 2, 3, 1, 2, 1])]
    calls_before = combined.infer_endpoint.stats.calls
    futures = [client.infer_rm_critic(b) for b in batches]
    answers = [f.result() for f in futures]
    assert combined.infer_endpoint.stats.calls - calls_before < len(batches), "never merged"
    for b, (_, values) in zip(batches, answers, strict=True):
        torch.testing.assert_close(values, offline_values(combined, b), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- train
def test_infer_train_infer_moves_values_toward_the_returns_and_keeps_the_rm(combined, client):
    batch = rollout(2, 8)
    rewards0, values0 = client.infer_rm_critic(batch).result()
    data = ppo_data(batch, values0)
    step0 = combined.step
    result = client.train(data).result()
    assert set(result) >= {
        "loss",
        "clip_fraction",
        "train_explained_variance",
        "grad_norm",
        "lr",
        "critic_step",
        "critic_optimizer_steps",
    }
    assert result["critic_step"] == step0 + 8 // GBS == step0 + result["critic_optimizer_steps"]
    assert result["loss"] > 0
    for _ in range(2):
        _, values = client.infer_rm_critic(batch).result()
        client.train(ppo_data(batch, values)).result()
    rewards1, values1 = client.infer_rm_critic(batch).result()
    assert masked_error(values1, data) < 0.5 * masked_error(values0, data)
    torch.testing.assert_close(rewards1, rewards0, atol=0, rtol=0)  # the reward model did not move


def test_a_train_followed_at_once_by_infer_sees_the_trained_critic(combined, client):
    batch = rollout(3, 4)
    before = offline_values(combined, batch)
    future = client.train(ppo_data(batch, before, target=-0.5))
    _rewards, values = client.infer_rm_critic(batch).result()  # sent right away, answered after train
    assert future.done() and future.exception() is None
    after = offline_values(combined, batch)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(values, after, atol=1e-5, rtol=1e-5)


def test_one_lock_serialises_infer_train_and_save(combined, client):
    active, peak = [0], [0]
    guard = threading.Lock()

    def tracked(fn):
        def wrapper(*args):
            with guard:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.02)
            try:
                return fn(*args)
            finally:
                with guard:
                    active[0] -= 1

        return wrapper

    endpoints = (combined.infer_endpoint, combined.train_endpoint, combined.save_endpoint)
    originals = (endpoints[0].forward, endpoints[1].train, endpoints[2].save)
    endpoints[0].forward, endpoints[1].train, endpoints[2].save = (tracked(f) for f in originals)
    try:
        batch = rollout(4, 2)
        _, values = client.infer_rm_critic(batch).result()
        raw = triton_http.InferenceServerClient(f"127.0.0.1:{combined.cfg.port}", concurrency=4)
        # a raw client does not wait for train the way RemoteGPTRMCriticClient does
        requests = [
            raw.async_infer(
                "critic_train", _train_tensors(ppo_data(batch, values)), parameters={TOKEN_PARAMETER: TOKEN}
            )
        ]
        requests += [raw.async_infer("critic_infer", _infer_tensors(batch)) for _ in range(3)]
        requests.append(raw.async_infer("critic_save", _save_tensors(), parameters={TOKEN_PARAMETER: TOKEN}))
        for r in requests:
            r.get_result()
        raw.close()
    finally:
        endpoints[0].forward, endpoints[1].train, endpoints[2].save = originals
    assert peak[0] == 1


def _infer_tensors(batch):
    tokens = triton_http.InferInput("tokens", list(batch["response_tokens"].shape), "INT64")
    tokens.set_data_from_numpy(batch["response_tokens"].numpy())
    lengths = triton_http.InferInput("sequence_lengths", [batch["response_tokens"].shape[0], 1], "INT64")
    lengths.set_data_from_numpy(batch["response_lengths"].numpy().reshape(-1, 1))
    return [tokens, lengths]


def _train_tensors(data):
    arrays = {
        "tokens": data["response_tokens"].numpy().astype(np.int64),
        "returns": data["returns"].numpy().astype(np.float32),
        "prev_values": data["values"].numpy().astype(np.float32),
        "mask": data["mask"].numpy().astype(np.float32),
    }
    return _tensors(arrays)


def _save_tensors():
    return _tensors({"dummy_var": np.zeros(1, np.int64)})


def _tensors(arrays):
    out = []
    for name, array in arrays.items():
        t = triton_http.InferInput(
            name, list(array.shape), {"int64": "INT64", "int32": "INT32"}.get(array.dtype.name, "FP32")
        )
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def _good_train_arrays():
    return {
        "tokens": np.full((2, 6), 7, np.int64),
        "returns": np.ones((2, 5), np.float32),
        "prev_values": np.zeros((2, 5), np.float32),
        "mask": np.ones((2, 5), np.float32),
    }


def _changed(name, value=None, shape=None, at=(0, 0)):
    arrays = _good_train_arrays()
    if shape is not None:
        arrays[name] = np.zeros(shape, arrays[name].dtype)
    else:
        arrays[name] = arrays[name].copy()
        arrays[name][at] = value
    return arrays


BAD_TRAIN = {
    "NaN in returns": (_changed("returns", np.nan, at=(1, 3)), "input 'returns': row 1, position 3 is nan"),
    "inf in prev_values": (
        _changed("prev_values", -np.inf),
        "input 'prev_values': row 0, position 0 is -inf",
    ),
    "NaN in mask": (_changed("mask", np.nan, at=(0, 4)), "input 'mask': row 0, position 4 is nan"),
    "returns as wide as tokens": (_changed("returns", shape=(2, 6)), "must be 5 wide (S-1)"),
    "mask rows differ": (_changed("mask", shape=(3, 5)), "'mask' has 3 rows but 'tokens' has 2"),
    "tokens as int32": (
        {**_good_train_arrays(), "tokens": np.full((2, 6), 7, np.int32)},
        "input 'tokens': expected int64 [N, S], got int32 [2, 6]",
    ),
    "missing prev_values": (
        {k: v for k, v in _good_train_arrays().items() if k != "prev_values"},
        "prev_values",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TRAIN))
def test_bad_train_input_is_refused_weights_unchanged_and_still_serving(combined, client, case):
    arrays, needle = BAD_TRAIN[case]
    before, step = state(combined.model), combined.step
    http = triton_http.InferenceServerClient(f"127.0.0.1:{combined.cfg.port}")
    try:
        with pytest.raises(InferenceServerException) as info:
            http.infer("critic_train", _tensors(arrays), parameters={TOKEN_PARAMETER: TOKEN})
    finally:
        http.close()
    assert needle in info.value.message()
    assert equal_state(before, state(combined.model)) and combined.step == step
    rewards, _ = client.infer_rm_critic(rollout(5, 2)).result()  # still serving
    assert rewards.shape == (2,)


def test_client_checks_train_data_before_sending(client):
    data = ppo_data(rollout(6, 2), torch.zeros(2, 19))
    with pytest.raises(BadRequestError, match=r"returns must be \[N, S-1\] = \[2, 19\]"):
        client.train({**data, "returns": torch.zeros(2, 20)})
    with pytest.raises(BadRequestError, match="values holds NaN or inf"):
        client.train({**data, "values": torch.full((2, 19), float("nan"))})
    with pytest.raises(BadRequestError, match="lacks"):
        client.train({"response_tokens": data["response_tokens"]})


# ---------------------------------------------------------------------------- token
def test_train_and_save_need_the_token_infer_does_not(combined, client):
    port = combined.cfg.port
    data = ppo_data(rollout(7, 2), torch.zeros(2, 19))
    before = state(combined.model)
    for token in (None, "wrong"):
        cfg = RemoteCriticConfig(
            pad_to_length=PAD_TO, critic=CriticAddress(port=port), token=token, init_timeout_s=10
        )
        with RemoteGPTRMCriticClient(cfg) as c:
            c.token = token  # ignore $OPENALIGNER_TOKEN in the test environment
            with pytest.raises(AuthenticationError, match="token"):
                c.train(data).result()
            with pytest.raises(AuthenticationError, match="token"):
                c.save().result()
            _rewards, values = c.infer_rm_critic(rollout(7, 2)).result()
            assert values.shape == (2, 19)
    assert equal_state(before, state(combined.model))


# ---------------------------------------------------------------------------- save / resume
def test_save_writes_a_checkpoint_a_new_server_resumes_from(combined, client, ckpt_dir, tiny):
    batch = rollout(8, 4)
    _, values = client.infer_rm_critic(batch).result()
    client.train(ppo_data(batch, values)).result()
    saved = client.save().result()
    assert saved == {"status": 0, "step": combined.step}
    latest = CheckpointManager(ckpt_dir).latest()
    assert latest == ckpt_dir / f"step_{combined.step}" and verify_checkpoint(latest) is None
    resumed = make_server(tiny, free_port(), combined=True, checkpoints=CheckpointManager(ckpt_dir))
    assert resumed.step == combined.step
    with combined.lock:
        assert equal_state(state(combined.model), state(resumed.model))
    assert resumed.reward_model is not None
    torch.testing.assert_close(  # the reward model is the original one, not the trained critic
        resumed.reward_model.infer(batch["response_tokens"], batch["response_lengths"]),
        tiny.reward_model().infer(batch["response_tokens"], batch["response_lengths"]),
    )


def test_a_crash_during_save_keeps_the_previous_checkpoint(combined, client, ckpt_dir, monkeypatch):
    client.save().result()
    previous = CheckpointManager(ckpt_dir).latest()
    batch = rollout(9, 4)
    _, values = client.infer_rm_critic(batch).result()
    client.train(ppo_data(batch, values)).result()

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(ServerError, match="disk full"):
        client.save().result()
    monkeypatch.undo()
    assert CheckpointManager(ckpt_dir).latest() == previous and verify_checkpoint(previous) is None
    assert client.save().result()["step"] == combined.step  # the server goes on, and saves again


def test_restore_sends_the_server_back_to_a_saved_step_and_refuses_one_it_lacks(combined, client):
    """What a resumed train-ppo does: critic_save with restore_step, over HTTP."""
    batch = rollout(10, 4)
    saved = client.save().result()["step"]
    with combined.lock:
        at_save = state(combined.model)
    _, values = client.infer_rm_critic(batch).result()
    client.train(ppo_data(batch, values)).result()
    assert combined.step > saved
    assert client.restore(saved).result() == {"status": 0, "step": saved}
    assert combined.step == saved
    with combined.lock:
        assert equal_state(state(combined.model), at_save)
    with pytest.raises(BadRequestError, match=r"cannot go back to critic step 999: there is no .*step_999; "):
        client.restore(999).result()
    assert combined.step == saved


def test_client_close_with_requests_in_flight_returns_promptly(combined):
    cfg = RemoteCriticConfig(
        pad_to_length=PAD_TO, critic=CriticAddress(port=combined.cfg.port), max_workers=2
    )
    c = RemoteGPTRMCriticClient(cfg)
    c.wait_until_ready()
    pending = [c.infer_rm_critic(rollout(20 + i, 2)) for i in range(12)]
    stopper = threading.Thread(target=c.close)
    stopper.start()
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert all(p.done() for p in pending)  # answered, cancelled or failed: none left pending
