"""RemoteGPTRMCriticClient without a server: config, local checks, result assembly and ordering."""

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from openaligner.clients.critic import RemoteCriticConfig, RemoteGPTRMCriticClient, RMCriticFutureResult
from openaligner.clients.errors import BadRequestError, ServerError
from openaligner.config import ConfigError, load_config
from openaligner.protocol import TOKEN_ENV, TOKEN_PARAMETER


class RecordingClient(RemoteGPTRMCriticClient):
    """Sends nothing: every request becomes a future the test settles by hand."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.sent: list[tuple[str, dict, object, Future]] = []
        self.idempotent: list[bool] = []

        def submit(model, inputs, postprocess, parameters=None, *, idempotent=True):
            future: Future = Future()
            self.sent.append((model, inputs, parameters, future))
            self.idempotent.append(idempotent)
            return future

        self._critic.submit = submit  # type: ignore[method-assign]


def rollout(rows=2, width=6):
    return {
        "response_tokens": torch.ones(rows, width, dtype=torch.long),
        "response_lengths": torch.full((rows,), width),
    }


def ppo_data(rows=2, width=6):
    return {
        "response_tokens": torch.ones(rows, width, dtype=torch.long),
        "returns": torch.zeros(rows, width - 1),
        "values": torch.zeros(rows, width - 1),
        "mask": torch.ones(rows, width - 1),
    }


def test_config_keys_follow_nemo_aligner_and_load_from_overrides():
    cfg = load_config(
        RemoteCriticConfig,
        None,
        ["critic.port=6000", "critic.name.train=my_train", "reward_model.port=6001", "pad_to_length=64"],
    )
    assert (
        cfg.critic.port == 6000
        and cfg.critic.name.train == "my_train"
        and cfg.critic.name.infer == "critic_infer"
    )
    assert cfg.reward_model.name == "reward_model" and cfg.reward_model.port == 6001
    assert cfg.combine_rm_and_critic_server and cfg.pad_to_length == 64
    with pytest.raises(ConfigError, match=r"critic\.port must be in 1\.\.65535"):
        load_config(RemoteCriticConfig, None, ["critic.port=0"])
    with pytest.raises(ConfigError, match="pad_to_length"):
        load_config(RemoteCriticConfig, None, ["pad_to_length=1"])


@pytest.fixture()
def client(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    c = RecordingClient(RemoteCriticConfig(pad_to_length=10, token="t0k"))
    yield c
    c.close()


def test_infer_request_is_padded_and_the_answer_trimmed(client):
    future = client.infer_rm_critic(rollout(rows=2, width=6))
    model, inputs, parameters, sent = client.sent[0]
    assert model == "critic_infer" and parameters is None  # infer carries no token
    assert inputs["tokens"].shape == (2, 10) and inputs["sequence_lengths"].tolist() == [[6], [6]]
    sent.set_result((torch.arange(20.0).reshape(2, 10), torch.tensor([1.0, 2.0])))
    rewards, values = future.result()
    assert rewards.tolist() == [1.0, 2.0]
    assert values.shape == (2, 5) and values[1].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]


def test_malformed_batches_are_refused_before_sending(client):
    with pytest.raises(BadRequestError, match="more than pad_to_length=10"):
        client.infer_rm_critic(rollout(width=11))
    with pytest.raises(BadRequestError, match="at least 2 wide"):
        client.infer_rm_critic(rollout(width=1))
    with pytest.raises(BadRequestError, match=r"mask must be \[N, S-1\] = \[2, 5\]"):
        client.train({**ppo_data(), "mask": torch.ones(2, 6)})
    with pytest.raises(BadRequestError, match="response_tokens must be an integer"):
        client.train({**ppo_data(), "response_tokens": torch.ones(2, 6)})
    assert client.sent == []


def test_train_and_save_carry_the_token_and_decode_their_answers(client):
    future = client.train(ppo_data())
    model, inputs, parameters, sent = client.sent[0]
    assert model == "critic_train" and parameters == {TOKEN_PARAMETER: "t0k"}
    assert sorted(inputs) == ["mask", "prev_values", "returns", "tokens"]
    sent.set_result({"loss": 0.5})
    assert future.result() == {"loss": 0.5}
    client.save()
    assert client.sent[1][0] == "critic_save" and client.sent[1][2] == {TOKEN_PARAMETER: "t0k"}
    # a train must never run twice; a save may (it writes the same state again)
    assert client.idempotent == [False, True]


def test_restore_asks_critic_save_for_a_step_with_the_token(client):
    client.restore(4)
    model, inputs, parameters, _ = client.sent[0]
    assert model == "critic_save" and parameters == {TOKEN_PARAMETER: "t0k"}
    assert inputs["restore_step"].tolist() == [4] and inputs["restore_step"].dtype == "int64"
    assert sorted(inputs) == ["dummy_var", "restore_step"]
    assert client.idempotent == [True]  # going back to the same checkpoint twice is going back once


def test_token_comes_from_the_environment_when_not_configured(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "env-secret")
    c = RemoteGPTRMCriticClient(RemoteCriticConfig())
    try:
        assert c.token == "env-secret"
    finally:
        c.close()


def test_infer_after_train_is_sent_only_once_train_is_answered(client):
    train = client.train(ppo_data())
    sent_infer = threading.Event()

    def infer():
        client.infer_rm_critic(rollout())
        sent_infer.set()

    thread = threading.Thread(target=infer)
    thread.start()
    time.sleep(0.2)
    assert not sent_infer.is_set() and len(client.sent) == 1  # held back behind the pending train
    client.sent[0][3].set_exception(ServerError("boom", url="u", model="critic_train"))
    thread.join(timeout=5)
    assert sent_infer.is_set() and client.sent[1][0] == "critic_infer"
    with pytest.raises(ServerError):  # the train's own outcome stays with its future
        train.result()


def test_result_waits_for_both_answers_and_raises_the_failure():
    critic: Future = Future()
    rewards: Future = Future()
    result = RMCriticFutureResult(critic, rewards, width=4, device=torch.device("cpu"))
    assert not result.done()
    with pytest.raises(TimeoutError):
        result.result(timeout=0.01)
    critic.set_exception(ServerError("critic down", url="u", model="critic_infer"))
    rewards.set_result(torch.ones(2))
    assert result.done()
    with pytest.raises(ServerError, match="critic down"):
        result.result()
    ok = RMCriticFutureResult(_done((torch.zeros(2, 8), None)), _done(torch.ones(2)), 4, torch.device("cpu"))
    r, v = ok.result()
    assert r.tolist() == [1.0, 1.0] and v.shape == (2, 3)


def _done(value):
    f: Future = Future()
    f.set_result(value)
    return f


def test_train_answer_decodes_explained_variance_after_when_the_server_sends_it(monkeypatch):
    import numpy as np

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    c = RemoteGPTRMCriticClient(RemoteCriticConfig(pad_to_length=10))
    decoders = []

    def submit(model, inputs, postprocess, parameters=None, *, idempotent=True):
        decoders.append(postprocess)
        return Future()

    c._critic.submit = submit  # type: ignore[method-assign]
    try:
        c.train(ppo_data())
    finally:
        c.close()
    scalars = {
        "loss_mean": 0.5,
        "clip_fraction": 0.1,
        "explained_variance": 0.2,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "step": 3,
        "optimizer_steps": 1,
    }
    older = {k: np.array([v], np.float32) for k, v in scalars.items()}
    answer = decoders[0](older)  # a server from before explained_variance_after
    assert "explained_variance_after" not in answer
    assert answer["train_explained_variance"] == pytest.approx(0.2)
    newer = {**older, "explained_variance_after": np.array([0.7], np.float32)}
    assert decoders[0](newer)["explained_variance_after"] == pytest.approx(0.7)
