"""Conversations through the three recipes: train-sft, train-rm and train-ppo lay the same
conversation out in the same tokens with a chat-template tokenizer, and record the layout."""

from __future__ import annotations

import json
from pathlib import Path

from openaligner.config import load_config
from openaligner.data.render import SequenceLayout
from openaligner.models.tokenizers import load_tokenizer
from openaligner.trainer.ppo_config import TrainPPOConfig
from openaligner.trainer.ppo_recipe import prepare_ppo_run
from openaligner.trainer.rm import RMConfig, build_rm_trainer
from openaligner.trainer.sft import SFTConfig, build_sft_trainer

TINY = [
    "model.tiny_hidden_size=32",
    "model.tiny_num_layers=1",
    "model.tiny_num_heads=2",
    "model.tiny_max_positions=128",
]
SYSTEM = {"role": "system", "content": "sort"}


def user(i: int) -> dict[str, str]:
    return {"role": "user", "content": f"{i} 1"}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def write(path: Path, records: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_sft_rm_and_ppo_render_a_conversation_the_same_way(tmp_path, chat_tokenizer):
    chat_tokenizer.save_pretrained(str(tmp_path / "tok"))
    tokenizer = f"tokenizer.path={tmp_path / 'tok'}"
    n = 4
    sft_data = write(
        tmp_path / "sft.jsonl", [{"messages": [SYSTEM, user(i), assistant(f"1 {i}")]} for i in range(n)]
    )
    rm_data = write(
        tmp_path / "rm.jsonl",
        [
            {
                "chosen": [SYSTEM, user(i), assistant(f"1 {i}")],
                "rejected": [SYSTEM, user(i), assistant(f"{i} 1")],
            }
            for i in range(n)
        ],
    )
    ppo_data = write(tmp_path / "ppo.jsonl", [{"messages": [SYSTEM, user(i)]} for i in range(n)])
    common = [
        "data.val_fraction=0",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=2",
        "progress=false",
    ]
    common += ["device=cpu"]
    sft = build_sft_trainer(
        load_config(
            SFTConfig,
            overrides=[
                f"data.train_path={sft_data}",
                f"output_dir={tmp_path / 'sft'}",
                tokenizer,
                *TINY,
                *common,
            ],
        )
    )
    rm = build_rm_trainer(
        load_config(
            RMConfig,
            overrides=[
                f"data.train_path={rm_data}",
                f"output_dir={tmp_path / 'rm'}",
                tokenizer,
                *TINY,
                *common,
            ],
        )
    )
    ppo = prepare_ppo_run(
        load_config(
            TrainPPOConfig,
            overrides=[
                f"data.train_path={ppo_data}",
                f"exp.output_dir={tmp_path / 'ppo'}",
                tokenizer,
                *(k.replace("model.", "actor.") for k in TINY),
                "data.seq_length=128",
                "trainer.num_rollout_samples=4",
                "trainer.rollout_micro_batch_size=4",
                "trainer.global_batch_size=4",
                "trainer.micro_batch_size=4",
                "trainer.val_check_interval=0",
                "device=cpu",
            ],
        )
    )
    ppo_prompts = ppo.prompts.train.prompts
    for i in range(n):
        example, pair = sft.train_items[i], rm.train_items[i]
        prompt = ppo_prompts[i]
        assert example.tokens[: example.prompt_length] == prompt == pair.chosen[: len(prompt)]
        assert example.tokens[example.prompt_length :] == pair.chosen[len(prompt) :]
        text = chat_tokenizer.decode(prompt)
        assert text.startswith("<bos><|im_start|>system\nsort<|im_end|>\n<|im_start|>user\n")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ppo.layout == SequenceLayout(add_bos=True, add_eos=True, chat_template=True)
    # the layout travels with the trained models
    sft.export(tmp_path / "sft_model")
    rm.export(tmp_path / "rm_model")
    for d in ("sft_model", "rm_model"):
        assert SequenceLayout.load(tmp_path / d) == SequenceLayout(chat_template=True)
        assert load_tokenizer(tmp_path / d).chat_template == chat_tokenizer.chat_template


def test_ppo_warns_when_the_actor_was_trained_with_another_layout(tmp_path, tiny, caplog):
    from openaligner.trainer.ppo_recipe import prompt_layout

    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")  # enough for the config to load
    SequenceLayout(add_bos=True, chat_template=True).save(tmp_path / "sft")
    cfg = load_config(TrainPPOConfig, overrides=[f"actor.path={tmp_path / 'sft'}", "data.train_path=p.jsonl"])
    assert prompt_layout(cfg, tiny.tokenizer) == SequenceLayout(chat_template=False)
    assert "trained with add_bos=True, chat_template=True" in caplog.text
    caplog.clear()
    SequenceLayout().save(tmp_path / "sft")
    prompt_layout(cfg, tiny.tokenizer)
    assert "trained with" not in caplog.text
