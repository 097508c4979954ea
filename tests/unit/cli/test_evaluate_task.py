"""``openaligner evaluate-task``: a model directory's gold score on a built-in task's prompts, checked
against a greedy generation by plain ``transformers``; the KL of a model to itself is 0 and to
another model is not; what cannot be evaluated is refused in one line with exit code 2."""

import json

import pytest
import torch

from openaligner.cli.main import main
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.tasks.reverse_text import gold_score, prompt_records


def _model_dir(path, seed):
    tokenizer = build_char_tokenizer()
    size = TinySize(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2)
    build_tiny_causal_lm("gpt2", size, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_records(0, 4, held_out=True)))
    return _model_dir(root / "a", seed=1), _model_dir(root / "b", seed=2), prompts


def _evaluate(capsys, *args):
    assert main(["evaluate-task", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_gold_score_matches_plain_transformers_and_kl_to_itself_is_zero(setup, capsys):
    a, _, prompts = setup
    got = _evaluate(capsys, a, "--task", "reverse_text", "--prompts", prompts, "--reference", a,
                    "--max-new-tokens", 6, "--limit", 3)  # fmt: skip
    # the reference: greedy by plain transformers, one prompt at a time, graded by the task's scorer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(a), AutoTokenizer.from_pretrained(a)
    records = [json.loads(line) for line in prompts.read_text().splitlines()][:3]
    scores = []
    for r in records:
        ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(r["prompt"])["input_ids"]]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=0)  # fmt: skip
        scores.append(
            gold_score(r["prompt"], tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        )
    assert got["prompts"] == 3 and got["task"] == "reverse_text"
    assert got["gold_greedy"] == pytest.approx(sum(scores) / 3, abs=1e-9)
    assert 0.0 <= got["gold"] <= 1.0 and 1.0 <= got["response_tokens"] <= 6.0
    assert got["kl_to_reference"] == pytest.approx(0.0, abs=1e-5)


def test_kl_to_another_model_is_not_zero(setup, capsys):
    a, b, prompts = setup
    got = _evaluate(capsys, a, "--task", "reverse_text", "--prompts", prompts, "--reference", b,
                    "--max-new-tokens", 4)  # fmt: skip
    assert got["prompts"] == 4
    # k1 on 4 samples is an unbiased but noisy estimate: its sign is noise, its size is not 0
    assert abs(got["kl_to_reference"]) > 0.01


def test_what_cannot_be_evaluated_is_refused_in_one_line(setup, tmp_path, capsys):
    a, _, prompts = setup
    adapter = tmp_path / "actor"
    (adapter / "merged").mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "merged" / "config.json").write_text("{}")
    cases = [
        ([adapter, "--task", "reverse_text", "--prompts", prompts], "use the merged directory"),
        ([tmp_path / "none", "--task", "reverse_text", "--prompts", prompts], "does not exist"),
        ([a, "--task", "reverse_text", "--prompts", tmp_path / "missing.jsonl"], "--prompts:"),
        ([a, "--task", "reverse_text", "--prompts", prompts, "--limit", 0], "--limit must be at least 1"),
    ]
    for args, message in cases:
        assert main(["evaluate-task", *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
