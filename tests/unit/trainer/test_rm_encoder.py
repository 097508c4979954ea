"""train-rm on an encoder (a BERT directory with its WordPiece tokenizer): no data.add_eos=false
needed (the tokenizer's ``[CLS] … [SEP]`` is the layout), the model learns a separable set and
exports a directory ``transformers`` scores the same; LoRA trains adapters and the head. Before,
the command refused the tokenizer ("has no EOS token"), then, with data.add_eos=false, crashed
with a traceback ("no linear `score` head")."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from openaligner.cli.main import main
from openaligner.data.render import SequenceLayout
from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel
from tiny_bert import tiny_bert_dir


def _pairs(path: Path, n: int = 48) -> Path:
    rng = random.Random(0)
    rows = [
        {
            "prompt": f"q {rng.randint(0, 9)} ?",
            "chosen": rng.choice(["yes", "yes !", "sure yes"]),
            "rejected": rng.choice(["no", "no !", "nope no"]),
        }
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        f"model.path={tiny_bert_dir(tmp_path / 'bert')}",
        f"data.train_path={_pairs(tmp_path / 'pairs.jsonl')}",
        "data.val_fraction=0.25",
        f"output_dir={tmp_path / 'rm'}",
        "trainer.global_batch_size=12",
        "trainer.micro_batch_size=12",
        "trainer.val_check_interval=100",
        "optim.lr=3e-3",
        "optim.scheduler=constant",
        "optim.warmup_steps=0",
        "progress=false",
        "device=cpu",
        *extra,
    ]


def test_train_rm_trains_an_encoder_with_its_own_tokenizer_layout(tmp_path, capsys):
    assert main(["train-rm", *_args(tmp_path, "trainer.max_steps=20")]) == 0
    out = tmp_path / "rm"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val/accuracy"] == 1.0
    assert SequenceLayout.load(out) == SequenceLayout()  # add_bos / add_eos: CLS and SEP
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    hf = AutoModelForSequenceClassification.from_pretrained(str(out), local_files_only=True).eval()
    texts = ["q 3 ? yes", "q 3 ? no"]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert enc["input_ids"][0, 0] == tok.cls_token_id
    with torch.no_grad():
        offline = hf(**enc).logits.reshape(-1)
    rm = RewardModel.from_pretrained(out)
    ours = rm.infer(enc["input_ids"], enc["attention_mask"].sum(-1))
    torch.testing.assert_close(ours, offline, rtol=0, atol=1e-5)
    assert ours[0] > ours[1]


def test_an_encoder_reward_model_is_refused_as_the_critics_start(tmp_path, capsys):
    bert = tiny_bert_dir(tmp_path / "bert")
    with pytest.raises(ValueError, match="cannot be a critic"):
        CriticModel.from_pretrained(bert)
    # serve-critic: one line and exit code 2 before any server starts, not a traceback
    assert main(["serve-critic", f"model.path={bert}", "runtime.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot be a critic" in err and "Traceback" not in err


def test_lora_on_an_encoder_trains_adapters_and_its_classifier(tmp_path):
    pytest.importorskip("peft")
    from openaligner.config import load_config
    from openaligner.trainer.rm import RMConfig, build_rm_trainer

    cfg = load_config(
        RMConfig, overrides=_args(tmp_path, "lora.r=4", "lora.merge_on_save=true", "trainer.max_steps=2")
    )
    trainer = build_rm_trainer(cfg)
    module = trainer.objective.module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer.fit()
    changed = {k for k, v in module.state_dict().items() if not torch.equal(before[k], v)}
    assert any("classifier.modules_to_save" in k for k in changed)  # the head trains in full
    assert all("lora_" in k or "classifier.modules_to_save" in k for k in changed)
    merged = RewardModel.from_pretrained(tmp_path / "rm" / "merged")
    tokens, lengths = torch.tensor([[2, 5, 6, 3, 0]]), torch.tensor([4])
    torch.testing.assert_close(merged.infer(tokens, lengths), module.infer(tokens, lengths))


def test_serve_critic_refuses_a_combined_reward_model_with_other_token_ids(tmp_path, capsys):
    """The combined server scores the critic's ids with the reward model too: a BERT reward model
    beside a critic with the char tokenizer would read char ids as WordPiece ids."""
    from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
    from openaligner.models.tokenizers import build_char_tokenizer

    char = build_char_tokenizer()
    critic = tmp_path / "critic"
    build_tiny_sequence_classifier("gpt2", TinySize(vocab_size=len(char)), 0).save_pretrained(str(critic))
    char.save_pretrained(str(critic))
    bert = tiny_bert_dir(tmp_path / "bert")
    assert (
        main(["serve-critic", f"model.path={critic}", f"reward_model.path={bert}", "runtime.device=cpu"]) == 2
    )
    err = capsys.readouterr().err
    assert "has its own tokenizer" in err and "serve-reward" in err and "Traceback" not in err


@pytest.mark.slow
def test_two_sharded_ranks_train_an_encoder_as_one_process_does(tmp_path):
    """parallel.strategy=fsdp shards BERT per layer (its ``_no_split_modules``) under torchrun
    (gloo, CPU): 3 steps give the same metrics as one process and the same weights within the
    rounding bound of test_supervised_distributed.py. Trained with plain SGD for the reason given
    there: AdamW turns the rounding noise of near-zero gradients into updates of up to lr (measured
    with AdamW: the pooler's bias 1.01e-5 apart with transformers 5.24, 4.5e-6 with earlier
    versions), which hides what this test checks."""
    from test_supervised_distributed import ATOL, sgd_run

    bert = tiny_bert_dir(tmp_path / "bert")
    one = sgd_run(tmp_path, "one", 1, "rm", f"model.path={bert}")
    fsdp = sgd_run(tmp_path, "fsdp", 2, "rm", f"model.path={bert}", "parallel.strategy=fsdp")
    for m_one, m_fsdp in zip(one["metrics"], fsdp["metrics"], strict=True):
        for key in ("train/loss", "train/accuracy", "train/grad_norm", "val/loss", "val/accuracy"):
            if key in m_one:
                assert m_fsdp[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-6), key
    assert one["weights"].keys() == fsdp["weights"].keys()
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(fsdp["weights"][name], tensor, rtol=0, atol=ATOL, msg=name)
    assert fsdp["forwards"] == [{"train": 6, "val": 2}] * 2
