"""The reward server's ``sentences`` see the token layout train-rm trained the reward model on.

The first test uses only what train-rm and the server expose (no layout API), so it also shows
the bug it guards: before the layout was shared, a sentence was tokenized without BOS/EOS and
scored differently from the same text in training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from openaligner.config import load_config
from openaligner.data.preference import collate_pairs
from openaligner.servers.reward import make_tokenize_func
from openaligner.trainer.rm import RMConfig, build_rm_trainer

PAIRS = [
    {"prompt": "sort 3 1 2:", "chosen": " 1 2 3", "rejected": " 3 2 1"},
    {"prompt": "sort b a:", "chosen": " a b", "rejected": " b a"},
]


def _rm_trainer(tmp_path: Path, *overrides: str):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    cfg = load_config(
        RMConfig,
        overrides=[
            f"data.train_path={data}",
            "data.val_fraction=0",
            f"output_dir={tmp_path / 'out'}",
            "model.tiny_hidden_size=32",
            "model.tiny_num_layers=1",
            "model.tiny_num_heads=2",
            "model.tiny_max_positions=64",
            "trainer.global_batch_size=2",
            "trainer.micro_batch_size=2",
            "progress=false",
            "device=cpu",
            *overrides,
        ],
    )
    return build_rm_trainer(cfg)


def test_sentences_get_the_tokens_and_scores_of_train_rms_layout(tmp_path):
    trainer = _rm_trainer(tmp_path)
    texts = [p["prompt"] + p[side] for p in PAIRS for side in ("chosen", "rejected")]
    tokens, lengths = make_tokenize_func(trainer.tokenizer, max_length=64)(texts)
    trained = [seq for pair in trainer.train_items for seq in (pair.chosen, pair.rejected)]
    assert [tokens[i, : int(n)].tolist() for i, n in enumerate(lengths)] == trained
    model = trainer.objective.module.eval()
    batch = collate_pairs(trainer.train_items, pad_id=0)
    with torch.no_grad():
        as_trained = model(batch["tokens"], batch["lengths"])  # chosen rows, then rejected rows
    served = model.infer(tokens, lengths)  # chosen, rejected of pair 0, then of pair 1
    torch.testing.assert_close(served, as_trained[[0, 2, 1, 3]], atol=1e-6, rtol=1e-6)


def test_the_layout_train_rm_records_is_the_one_the_server_applies(tmp_path):
    from openaligner.data.render import SequenceLayout

    trainer = _rm_trainer(tmp_path, "data.add_bos=false", "trainer.max_steps=1", "trainer.save_interval=0")
    trainer.export(tmp_path / "rm")
    layout = SequenceLayout.load(tmp_path / "rm")
    assert layout == SequenceLayout(add_bos=False, add_eos=True, chat_template=False)
    tokens, lengths = make_tokenize_func(trainer.tokenizer, layout=layout)(
        [PAIRS[0]["prompt"] + PAIRS[0]["chosen"]]
    )
    assert tokens[0, : int(lengths[0])].tolist() == trainer.train_items[0].chosen


def test_no_doubled_specials_empty_texts_and_truncation(tiny):
    tok = tiny.tokenizer
    tokenize = make_tokenize_func(tok, max_length=6)
    tokens, lengths = tokenize(["<bos>ab<eos>", "", "abcdefgh"])
    ab = tok("ab", add_special_tokens=False)["input_ids"]
    assert tokens[0, : int(lengths[0])].tolist() == [2, *ab, 1]  # BOS/EOS written in the text count
    assert int(lengths[1]) == 0  # nothing of its own: refused upstream as "has no tokens"
    cut = tok("abcd", add_special_tokens=False)["input_ids"]
    assert tokens[2, : int(lengths[2])].tolist() == [2, *cut, 1]  # the text is cut, BOS and EOS kept
