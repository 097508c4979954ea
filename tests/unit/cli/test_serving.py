"""What both server commands share (cli/serving.py): the layout of `sentences`, LoRA on the critic."""

from __future__ import annotations

import logging

import pytest
import torch

from openaligner.cli import serve_critic, serving
from openaligner.config import ConfigError, load_config
from openaligner.data.render import SequenceLayout
from openaligner.models.lora import is_peft_model
from openaligner.models.precision import Precision
from openaligner.models.tokenizers import build_char_tokenizer

CPU = torch.device("cpu")


def test_sentences_are_laid_out_as_the_reward_models_directory_records(tmp_path):
    tok = build_char_tokenizer()
    text_ids = tok("ab", add_special_tokens=False)["input_ids"]
    default = serving.sentences_tokenizer(tok, str(tmp_path), None)  # no record: train-rm's default
    assert default is not None
    tokens, lengths = default(["ab"])
    assert tokens[0, : int(lengths[0])].tolist() == [tok.bos_token_id, *text_ids, tok.eos_token_id]
    SequenceLayout(add_bos=False, add_eos=False).save(tmp_path)
    recorded = serving.sentences_tokenizer(tok, str(tmp_path), None)
    assert recorded is not None
    tokens, lengths = recorded(["ab"])
    assert tokens[0, : int(lengths[0])].tolist() == text_ids
    assert serving.sentences_tokenizer(None, str(tmp_path), None) is None


def test_an_unreadable_layout_record_is_a_startup_refusal(tmp_path):
    (tmp_path / "sequence_layout.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"sequence_layout\.json"):
        serving.sentences_tokenizer(build_char_tokenizer(), str(tmp_path), None)


def test_the_critic_server_refuses_a_merged_export_it_cannot_write():
    with pytest.raises(ConfigError, match=r"lora\.merge_on_save"):
        load_config(serve_critic.SCHEMA, None, ["model.tiny=gpt2", "lora.r=4", "lora.merge_on_save=true"])


def test_a_lora_critic_starts_from_the_same_adapters_on_every_start():
    """Replicas on every rank, and a restart before its first checkpoint, need identical adapters."""
    cfg = load_config(serve_critic.SCHEMA, None, ["model.tiny=gpt2", "lora.r=4"])
    fp32 = Precision.resolve("fp32", CPU)
    log = logging.getLogger("test")

    def start() -> dict[str, torch.Tensor]:
        critic, _, _ = serve_critic.load_models(cfg, CPU, fp32, log)  # with its adapters
        assert is_peft_model(critic.hf_model)
        return {k: v.clone() for k, v in critic.state_dict().items() if "lora_" in k}

    torch.manual_seed(123)
    first = start()
    torch.manual_seed(456)  # whatever the process's RNG did before
    second = start()
    assert first and first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
