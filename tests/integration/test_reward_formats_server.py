"""Other frameworks' trainers against a real reward server: requests built as OpenRLHF's, slime's and
verl's clients build them (one sample per POST, with aiohttp), scored by a chat-template reward
model combined with a reward function, must equal the offline scores of the text laid out as
train-rm did, and 32 such clients at once must be batched together by Triton."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch
from procs import free_port

from chatml import CHATML
from openaligner.data.formats import PreferenceRecord
from openaligner.data.preference import build_preference_pairs
from openaligner.data.render import Renderer, SequenceLayout
from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.servers.reward import RewardModelServer, make_render_func, make_tokenize_func

pytestmark = pytest.mark.slow

CHAT = SequenceLayout(chat_template=True)
MODEL_WEIGHT, FUNCTION_WEIGHT = 0.5, 2.0


class LabelReward:
    """The served function: ``len(response)``, plus 10 when the sample's label is in the response."""

    def __call__(
        self, prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        return [
            len(r) + (10.0 if str(m.get("label")) in r else 0.0)
            for r, m in zip(responses, metadata, strict=True)
        ]


class Served:
    def __init__(self) -> None:
        tok = build_char_tokenizer()
        tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
        tok.chat_template = CHATML
        size = TinySize(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4)
        self.tokenizer = tok
        self.model = RewardModel(build_tiny_sequence_classifier("gpt2", size, seed=0)).eval()
        self.function = LabelReward()
        self.tokenize = make_tokenize_func(tok, max_length=256, layout=CHAT)
        self.port = free_port()
        self.server = RewardModelServer(
            self.model.infer,
            self.tokenize,
            port=self.port,
            render_func=make_render_func(tok, CHAT),
            reward_function=self.function,
            function_name="LabelReward",
            model_weight=MODEL_WEIGHT,
            function_weight=FUNCTION_WEIGHT,
            chat_template=True,  # as serve-reward sets it from the model's recorded layout
            vocab_size=len(tok),
            max_sequence_length=256,
            max_queue_delay_microseconds=100_000,  # hold requests so that concurrent clients merge
            inference_micro_batch_size=[32],
            model_forward_micro_batch_size=32,
            max_batch_size=64,
            heartbeat_s=None,
        )
        self.batches: list[int] = []
        """Requests per formed batch (the function is called per request, the model per batch)."""
        run = self.server.endpoint.run

        def recording_run(requests: Any) -> Any:
            self.batches.append(len(requests))
            return run(requests)

        self.server.endpoint.run = recording_run  # type: ignore[method-assign]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def model_score_of_text(self, text: str) -> float:
        """The model's score of a whole, already rendered text (BOS/EOS as train-rm added them)."""
        tokens, lengths = self.tokenize([text])
        return float(self.model.infer(tokens, lengths)[0])

    def model_score_of_conversation(self, prompt: list[dict[str, str]], response: str) -> float:
        """The model's score of the ids train-rm made of the conversation (its data path)."""
        record = PreferenceRecord(tuple(prompt), *[{"role": "assistant", "content": response}] * 2, "test")
        [pair] = build_preference_pairs([record], Renderer(self.tokenizer, CHAT), max_length=256)
        ids = pair.chosen
        return float(self.model.infer(torch.tensor([ids]), torch.tensor([len(ids)]))[0])

    def rendered_prompt(self, question: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )


@pytest.fixture(scope="module")
def served():
    s = Served()
    s.server.start()
    yield s
    s.server.stop()


# The three clients, written as those frameworks send: one sample per POST, JSON via aiohttp,
# raise_for_status, the score read where each framework reads it.
async def openrlhf_reward(
    session: aiohttp.ClientSession, url: str, query: str, prompt: str, label: str
) -> float:
    payload = {"query": [query], "prompts": [prompt], "labels": [label]}
    async with session.post(url, json=payload) as response:
        response.raise_for_status()
        return (await response.json())["rewards"][0]


async def slime_reward(session: aiohttp.ClientSession, url: str, sample: dict[str, Any]) -> float:
    async with session.post(url, json=sample) as response:
        response.raise_for_status()
        return await response.json()


async def verl_reward(session: aiohttp.ClientSession, url: str, text: str | list[dict[str, str]]) -> float:
    """verl's reward loop: the rendered conversation as ``input`` (or, here, the conversation as
    ``messages``), the raw score read from ``data[-1].probs[-1]``."""
    sample = {"input": text} if isinstance(text, str) else {"messages": text}
    payload = {"model": "/models/my-rm", **sample, "activation": False}
    async with session.post(url, json=payload) as response:
        response.raise_for_status()
        return (await response.json())["data"][-1]["probs"][-1]


def expected(s: Served, model_score: float, response: str, label: str | None = None) -> float:
    function = len(response) + (10.0 if label is not None and label in response else 0.0)
    return MODEL_WEIGHT * model_score + FUNCTION_WEIGHT * function


def test_each_framework_gets_the_offline_score_of_the_text_laid_out_as_train_rm_did(served):
    s = served
    prompt = s.rendered_prompt("2+2?")
    query = prompt + "4<|im_end|>"  # OpenRLHF decodes prompt and response tokens with their EOS
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    verl_text = s.tokenizer.apply_chat_template(
        [*conversation, {"role": "assistant", "content": "four"}], tokenize=False
    )

    async def ask() -> tuple[float, float, float, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(
                openrlhf_reward(session, s.url("/get_reward"), query, prompt, "4"),
                slime_reward(session, s.url("/remote_rm"), {"prompt": prompt, "response": "4", "label": "5"}),
                slime_reward(
                    session, s.url("/remote_rm"), {"prompt": conversation, "response": "4", "label": "4"}
                ),
                verl_reward(session, s.url("/classify"), verl_text),
            )

    got = asyncio.run(ask())
    want = [
        # a rendered prompt string: the model reads the whole text, the function the response
        expected(s, s.model_score_of_text(query), "4<|im_end|>", "4"),
        expected(s, s.model_score_of_text(prompt + "4"), "4", "5"),
        # a conversation: rendered with the reward model's own template, as train-rm did
        expected(s, s.model_score_of_conversation(conversation, "4"), "4", "4"),
        # a whole text: the model reads the conversation it renders as train-rm laid it out; the
        # function sees the text as the response to an empty prompt
        expected(s, s.model_score_of_conversation(conversation, "four"), verl_text),
    ]
    assert got == pytest.approx(want, abs=1e-4)
    assert len(set(got)) == 4  # the four cases differ, so each was read its own way


def test_a_rendered_conversation_scores_as_train_rm_laid_it_out_in_every_format(served):
    """verl posts the whole conversation rendered with the reward model's template (ChatML: it
    ends ``<|im_end|>\\n``); the model must read train-rm's ids, ``[..., <|im_end|>, <eos>]``, not
    ``[..., <|im_end|>, \\n, <eos>]`` — in ``/classify``'s ``input`` and ``messages`` and in
    OpenRLHF's ``query`` alike."""
    s = served
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    response = "six"
    whole = [*conversation, {"role": "assistant", "content": response}]
    text = s.tokenizer.apply_chat_template(whole, add_generation_prompt=False, tokenize=False)
    assert text.endswith("<|im_end|>\n")
    prompt = s.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    async def ask() -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return list(
                await asyncio.gather(
                    verl_reward(session, s.url("/classify"), text),
                    verl_reward(session, s.url("/v1/classify"), whole),
                    openrlhf_reward(session, s.url("/get_reward"), text, prompt, "six"),
                )
            )

    model = s.model_score_of_conversation(conversation, response)
    tok = s.tokenizer
    kept_newline = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    misread = float(s.model.infer(torch.tensor([kept_newline]), torch.tensor([len(kept_newline)]))[0])
    assert abs(model - misread) > 1e-3  # the layout changes the score: the test can tell them apart
    got = asyncio.run(ask())
    want = [
        expected(s, model, text),  # a whole text: the function reads it all
        expected(s, model, response),  # a conversation: the function reads the response
        expected(s, model, text[len(prompt) :], "six"),  # the query after its prompt
    ]
    assert got == pytest.approx(want, abs=1e-4)


def test_32_one_sample_clients_of_every_format_are_batched_together_and_each_gets_its_own_score(served):
    s = served
    prompts = [s.rendered_prompt(f"q{i}") for i in range(32)]
    responses = ["x" * (1 + i % 7) for i in range(32)]

    async def one(session: aiohttp.ClientSession, i: int) -> float:
        if i % 3 == 0:
            return await openrlhf_reward(
                session, s.url("/get_reward"), prompts[i] + responses[i], prompts[i], "x"
            )
        if i % 3 == 1:
            return await slime_reward(
                session, s.url("/remote_rm"), {"prompt": prompts[i], "response": responses[i]}
            )
        return await verl_reward(session, s.url("/v1/classify"), prompts[i] + responses[i])

    async def ask() -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return list(await asyncio.gather(*(one(session, i) for i in range(32))))

    batches_before = len(s.batches)
    got = asyncio.run(ask())
    want = []
    for i in range(32):
        model = s.model_score_of_text(prompts[i] + responses[i])
        response = responses[i] if i % 3 != 2 else prompts[i] + responses[i]
        want.append(expected(s, model, response, "x" if i % 3 == 0 else None))
    assert got == pytest.approx(want, abs=1e-4)
    batches = s.batches[batches_before:]
    assert sum(batches) == 32 and len(batches) < 32 and max(batches) > 1, batches  # requests were merged
