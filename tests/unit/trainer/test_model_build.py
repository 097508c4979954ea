"""The one model build of every command (trainer/model_build.py), in one process: its order, its
refusals and its seeds. Sharded builds run in tests/unit/trainer/test_supervised_distributed.py
and tests/integration/test_sharded_servers.py."""

from __future__ import annotations

import pytest
import torch

from openaligner.config import StartupError
from openaligner.models.lora import LoraConfig, is_peft_model
from openaligner.models.sharding import ParallelConfig
from openaligner.models.tokenizers import build_word_tokenizer
from openaligner.trainer.model_build import SharedState, build_trainable_model

CPU = torch.device("cpu")


def test_a_tokenizer_the_model_cannot_embed_is_refused_before_any_adapter(tiny):
    seen = []
    wide = build_word_tokenizer([f"w{i}" for i in range(200)])  # more ids than the tiny model's 100 rows
    with pytest.raises(StartupError, match=r"reward_model embeds only 100 .*; serve it apart"):
        build_trainable_model(
            lambda device, *, skeleton: tiny.reward_model(),
            ParallelConfig(),
            CPU,
            name="reward model",
            tokenizer=wide,
            vocab_key="reward_model",
            vocab_fix="serve it apart",
            before_sharding=lambda model, state: seen.append(model),
        )
    assert seen == []


def test_the_hook_sees_the_model_with_its_adapters_before_sharding(tiny):
    pytest.importorskip("peft")
    seen: list[tuple[torch.nn.Module, SharedState]] = []
    loads: list[tuple[torch.device, bool]] = []

    def load(device: torch.device, *, skeleton: bool):
        loads.append((device, skeleton))
        return tiny.causal_lm()

    model = build_trainable_model(
        load,
        ParallelConfig(),
        CPU,
        name="actor",
        tokenizer=tiny.tokenizer,
        lora=LoraConfig(r=4),
        rank_seed=0,
        before_sharding=lambda model, state: seen.append((model, state)),
    )
    assert loads == [(CPU, False)]  # one process: read whole, never a skeleton
    assert seen == [(model, None)] and is_peft_model(model)


def test_a_lora_seed_draws_the_same_adapters_whatever_the_rng_did_before(tiny):
    pytest.importorskip("peft")

    def adapters(seed_before: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed_before)
        critic = build_trainable_model(
            lambda device, *, skeleton: tiny.critic(),
            ParallelConfig(),
            CPU,
            name="critic",
            tokenizer=None,
            lora=LoraConfig(r=4),
            lora_seed=0,
        )
        return {k: v for k, v in critic.state_dict().items() if "lora_A" in k}

    first, second = adapters(1), adapters(2)
    assert first and all(torch.equal(first[k], second[k]) for k in first)
