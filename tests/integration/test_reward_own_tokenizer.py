"""A reward model with its own tokenizer, end to end over HTTP: a policy with a char tokenizer, a
reward model with a trained BPE tokenizer behind a real ``RewardModelServer``. ``auto`` finds the
tokenizers differ, sends each rollout as its conversation, and the reward is the one the reward
model gives the same text laid out with its own tokenizer, as in training. Before
``remote.reward_input``, the trainer sent the policy's char ids to this BPE model (a different,
meaningless reward)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from procs import free_port

from openaligner.clients.critic import RemoteCriticConfig, RemoteGPTRMCriticClient, TokenizerIdentity
from openaligner.data.render import Renderer, SequenceLayout, tokenizer_identity
from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import build_char_tokenizer, train_bpe_tokenizer
from openaligner.protocol import tokenizer_description
from openaligner.servers.reward import RewardModelServer, make_render_func, make_tokenize_func
from openaligner.trainer.rollout import RolloutConversations

LAYOUT = SequenceLayout()
PROMPTS = ["sort 3 1 2:", "sort b a:"]
RESPONSES = [" 1 2 3", " a b"]


@pytest.fixture(scope="module")
def reward_server():
    bpe = train_bpe_tokenizer(
        [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)] * 8,
        300,
        ["<pad>", "<eos>", "<bos>"],
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
    )
    model = RewardModel(
        build_tiny_sequence_classifier("gpt2", TinySize(vocab_size=len(bpe), hidden_size=32, num_heads=2), 0)
    ).eval()
    server = RewardModelServer(
        infer_fn=model.infer,
        tokenize_func=make_tokenize_func(bpe, layout=LAYOUT),
        render_func=make_render_func(bpe, LAYOUT),
        tokenizer_info=tokenizer_description(*tokenizer_identity(bpe, LAYOUT)),
        port=free_port(),
        inference_micro_batch_size=[2],
        model_forward_micro_batch_size=2,
        vocab_size=len(bpe),
        max_sequence_length=64,
    )
    server.start()
    yield server, model, bpe
    server.stop()


def policy_rollout(char) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    renderer = Renderer(char, LAYOUT)
    prompts = [renderer.prompt_ids(p) for p in PROMPTS]
    rows = [
        [*p, *char(r, add_special_tokens=False)["input_ids"], char.eos_token_id]
        for p, r in zip(prompts, RESPONSES, strict=True)
    ]
    width = max(len(r) for r in rows) + 3
    tokens = torch.full((len(rows), width), char.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    batch = {
        "response_tokens": tokens,
        "prompt_lengths": torch.tensor([len(p) for p in prompts]),
        "response_lengths": torch.tensor([len(r) for r in rows]),
        "is_end": torch.ones(len(rows), dtype=torch.bool),
    }
    return batch, prompts


def critic_answering_values(client: RemoteGPTRMCriticClient, char) -> None:
    """The critic server stands in: it has the policy's tokenizer and answers zero values."""
    described = tokenizer_description(*tokenizer_identity(char, LAYOUT))["tokenizer"]
    client._critic.tokenizer = lambda model: described  # type: ignore[method-assign,assignment,return-value]

    def submit(model, inputs, postprocess, parameters=None, *, idempotent=True):
        f: Future = Future()
        f.set_result((torch.zeros(inputs["tokens"].shape[0], inputs["tokens"].shape[1]), None))
        return f

    client._critic.submit = submit  # type: ignore[method-assign]


def test_text_mode_gives_the_reward_of_the_reward_models_own_layout(reward_server):
    server, model, bpe = reward_server
    char = build_char_tokenizer()
    batch, prompts = policy_rollout(char)
    cfg = RemoteCriticConfig(
        combine_rm_and_critic_server=False, reward_input="auto", init_timeout_s=10, pad_to_length=None
    )
    cfg.reward_model.port = server.cfg.port
    client = RemoteGPTRMCriticClient(cfg)
    try:
        critic_answering_values(client, char)
        client._rm.wait_until_ready()  # type: ignore[union-attr]
        described = client._rm.tokenizer()  # type: ignore[union-attr]
        assert described is not None and described["fingerprint"] == tokenizer_identity(bpe, LAYOUT)[1]

        def decode(ids):
            return char.decode(ids, skip_special_tokens=True)

        policy = TokenizerIdentity(*tokenizer_identity(char, LAYOUT))
        mode = client.configure_reward_input(policy, RolloutConversations(prompts, PROMPTS, decode))
        assert mode == "text"
        rewards, values = client.infer_rm_critic(batch).result(timeout=30)
    finally:
        client.close()

    rm_renderer = Renderer(bpe, LAYOUT)
    expected = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        prompt_ids, response_ids = rm_renderer.example_ids(p, {"role": "assistant", "content": r})
        ids = torch.tensor([prompt_ids + response_ids])
        expected.append(model.infer(ids, torch.tensor([ids.shape[1]])).float().reshape(-1))
    torch.testing.assert_close(rewards, torch.cat(expected))
    assert values.shape == (2, batch["response_tokens"].shape[1] - 1)
    # what the trainer sent before: the policy's char ids, read by the BPE model as other tokens
    policy_ids = model.infer(batch["response_tokens"], batch["response_lengths"]).float().reshape(-1)
    assert not torch.allclose(policy_ids, rewards)


def test_the_tokenizer_route_says_when_there_is_no_tokenizer(reward_server):
    _server, model, _ = reward_server
    bare = RewardModelServer(infer_fn=model.infer, port=free_port(), inference_micro_batch_size=[2])
    bare.start()
    try:
        cfg = RemoteCriticConfig(combine_rm_and_critic_server=False, reward_input="auto", init_timeout_s=10)
        cfg.reward_model.port = bare.cfg.port
        client = RemoteGPTRMCriticClient(cfg)
        try:
            critic_answering_values(client, build_char_tokenizer())
            client._rm.wait_until_ready()  # type: ignore[union-attr]
            assert client._rm.tokenizer() is None  # type: ignore[union-attr]
            policy = TokenizerIdentity(*tokenizer_identity(build_char_tokenizer(), LAYOUT))
            assert client.configure_reward_input(policy, RolloutConversations([], [], str)) == "tokens"
        finally:
            client.close()
    finally:
        bare.stop()
