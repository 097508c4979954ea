"""The seed API's names (openaligner/seed_api.py) resolve to the real objects, as
docs/architecture.md ("The seed API's names") lists them."""

import re
from pathlib import Path

import pytest
import torch

from openaligner import seed_api
from openaligner.clients.critic import RemoteGPTRMCriticClient, RMCriticFutureResult
from openaligner.clients.reward import RemoteGPTRMClient
from openaligner.models.actor import CausalLMActor
from openaligner.models.critic import CriticModel
from openaligner.models.generation import SamplingParams
from openaligner.seed_api import MegatronGPTActorModel
from openaligner.servers.critic import CriticServerTrainer
from openaligner.servers.reward import RewardModelServer
from openaligner.trainer.ppo import PPOTrainer

DOC = Path(__file__).parents[2] / "docs" / "architecture.md"


@pytest.mark.parametrize(
    ("name", "real"),
    [
        ("MegatronGPTActorModel", CausalLMActor),
        ("MegatronGPTCriticModel", CriticModel),
        ("RemoteGPTRMCriticClient", RemoteGPTRMCriticClient),
        ("RMCriticFutureResult", RMCriticFutureResult),
        ("RemoteGPTRMClient", RemoteGPTRMClient),
        ("CriticServerTrainer", CriticServerTrainer),
        ("RewardModelServer", RewardModelServer),
        ("PPOTrainer", PPOTrainer),
    ],
)
def test_a_seed_name_is_the_openaligner_object(name, real):
    assert getattr(seed_api, name) is real
    assert name in seed_api.__all__


def test_every_seed_method_is_the_method_of_the_class_its_seed_name_aliases():
    assert seed_api.SEED_METHODS, "no seed methods listed"
    for dotted, method in seed_api.SEED_METHODS.items():
        cls_name, attr = dotted.split(".")
        cls = getattr(seed_api, cls_name)
        assert getattr(cls, attr) is method, dotted


def test_the_actor_returns_the_seed_rollout_keys(tiny):
    actor = MegatronGPTActorModel(
        tiny.causal_lm(), sampling=SamplingParams(max_new_tokens=2), init_policy=False
    )
    prompts = {"text": torch.tensor([[5, 6, 7], [8, 9, 1]]), "length": torch.tensor([3, 2])}
    out = actor.infer(prompts, generator=torch.Generator().manual_seed(0))
    assert set(out) == set(seed_api.ROLLOUT_BATCH_KEYS)
    # response_tokens / response_lengths hold the whole sequence: each row starts with its prompt
    assert out["response_tokens"][0, :3].tolist() == [5, 6, 7]
    assert (out["response_lengths"] > out["prompt_lengths"]).all()


def test_the_architecture_doc_lists_every_seed_name():
    text = DOC.read_text()
    section = text[text.index("## The seed API's names") :].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([A-Za-z_.]+)`", section, flags=re.M))
    public = {n for n in seed_api.__all__ if not n.isupper()}
    missing = (public | set(seed_api.SEED_METHODS)) - listed
    assert not missing, f"seed names not in docs/architecture.md: {sorted(missing)}"
