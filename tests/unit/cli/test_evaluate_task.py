"""``openaligner evaluate-task``: a model directory's gold score on a built-in task's prompts, checked
against a greedy generation by plain ``transformers``; the exact-task rate of a scripted policy
that reverses (1.0) and of one that copies forwards (0.0, while its LCS gold score is > 0: the
reward hack the score alone cannot see); one section per split, with example answers; a LoRA
adapter evaluated over its base equals its merged export; the KL of a model to itself is 0 and
to another model is not; what cannot be evaluated is refused in one line with exit code 2."""

import json

import pytest
import torch

from openaligner.cli.main import main
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.tasks.reverse_text import (
    ReverseTextConfig,
    answer,
    gold_score,
    parse_prompt,
    prompt_records,
    unseen_words_records,
)


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


@pytest.fixture(scope="module")
def two_splits(tmp_path_factory):
    """The held-out combinations and the unseen-words split, 5 prompts each, as the docs write them."""
    root = tmp_path_factory.mktemp("splits")
    cfg = ReverseTextConfig(min_words=2, max_words=3)
    paths = []
    splits = (("heldout", prompt_records(0, 5, True, cfg)), ("unseen", unseen_words_records(0, 5, cfg)))
    for name, rows in splits:
        paths.append(root / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def _evaluate(capsys, *args):
    assert main(["evaluate-task", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


class ScriptedPolicy:
    """A policy that answers each reverse-text prompt by a script: the text reversed (``reverse``)
    or as it is (``copy``), then a line break — token by token in the char tokenizer, shaped as
    :meth:`CausalLMActor.infer` returns rollouts (right-padded prompt + response rows)."""

    def __init__(self, tokenizer, behaviour):
        from openaligner.models.generation import SamplingParams

        self.tokenizer, self.behaviour = tokenizer, behaviour
        self.sampling = SamplingParams(max_new_tokens=64)

    def infer(self, batch, sampling=None, generator=None):
        rows, starts, ends = [], [], []
        for ids, length in zip(batch["text"], batch["length"], strict=True):
            prompt_ids = ids[: int(length)].tolist()
            text = parse_prompt(self.tokenizer.decode(prompt_ids, skip_special_tokens=True))
            said = text[::-1] if self.behaviour == "reverse" else text
            response = self.tokenizer.encode(f" {said}\n", add_special_tokens=False)
            rows.append(prompt_ids + response)
            starts.append(len(prompt_ids))
            ends.append(len(rows[-1]))
        tokens = torch.zeros(len(rows), max(ends), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        return {
            "response_tokens": tokens,
            "prompt_lengths": torch.tensor(starts),
            "response_lengths": torch.tensor(ends),
            "is_end": torch.ones(len(rows), dtype=torch.bool),
        }


@pytest.mark.parametrize("behaviour", ["reverse", "copy"])
def test_the_exact_rate_of_a_scripted_policy_on_both_splits(
    setup, two_splits, capsys, monkeypatch, behaviour
):
    from openaligner.models.actor import CausalLMActor

    a, _, _ = setup
    scripted = ScriptedPolicy(build_char_tokenizer(), behaviour)
    monkeypatch.setattr(CausalLMActor, "from_pretrained", classmethod(lambda cls, *args, **kw: scripted))
    heldout, unseen = two_splits
    got = _evaluate(capsys, a, "--task", "reverse_text", "--prompts", heldout, "--prompts", unseen,
                    "--max-new-tokens", 40, "--examples", 2)  # fmt: skip
    assert sorted(got["splits"]) == ["heldout", "unseen"]
    for name, path in (("heldout", heldout), ("unseen", unseen)):
        split = got["splits"][name]
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert split["prompts"] == 5
        if behaviour == "reverse":
            assert split["exact"] == split["exact_greedy"] == 1.0
            assert split["gold"] == split["gold_greedy"] == 1.0
        else:  # copying forwards shares characters with the reversal: the score rises, no task done
            assert split["exact"] == split["exact_greedy"] == 0.0
            assert 0.0 < split["gold_greedy"] < 1.0
            text = parse_prompt(records[0]["prompt"])
            assert split["examples"][0]["greedy"] == f" {text}\n"
        assert [e["prompt"] for e in split["examples"]] == [r["prompt"] for r in records[:2]]
        assert [e["target"] for e in split["examples"]] == [answer(r["prompt"]) for r in records[:2]]


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
    assert got["task"] == "reverse_text" and list(got["splits"]) == ["prompts"]
    got = got["splits"]["prompts"]
    assert got["prompts"] == 3
    assert got["gold_greedy"] == pytest.approx(sum(scores) / 3, abs=1e-9)
    assert 0.0 <= got["exact"] <= 1.0 and 0.0 <= got["exact_greedy"] <= 1.0
    assert [e["target"] for e in got["examples"]] == [r["answer"] for r in records]
    assert 0.0 <= got["gold"] <= 1.0 and 1.0 <= got["response_tokens"] <= 6.0
    assert got["kl_to_reference"] == pytest.approx(0.0, abs=1e-5)


def test_kl_to_another_model_is_not_zero(setup, capsys):
    a, b, prompts = setup
    got = _evaluate(capsys, a, "--task", "reverse_text", "--prompts", prompts, "--reference", b,
                    "--max-new-tokens", 4)  # fmt: skip
    got = got["splits"]["prompts"]
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
        ([adapter, "--task", "reverse_text", "--prompts", prompts], "with --base"),
        ([a, "--task", "reverse_text", "--prompts", prompts, "--base", a], "holds no adapter_config.json"),
        ([a, "--task", "reverse_text", "--prompts", prompts, "--prompts", prompts], "two files named"),
    ]
    for args, message in cases:
        assert main(["evaluate-task", *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_an_adapter_checkpoint_over_its_base_scores_as_its_merged_export(setup, tmp_path, capsys):
    """``evaluate-task step_<N>/actor --base BASE``: the adapter merged in memory gives the numbers
    of the merged directory a run writes (lora.merge_on_save)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    a, _, prompts = setup
    model = AutoModelForCausalLM.from_pretrained(a)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False)
    adapted = peft.get_peft_model(model, lora)
    adapter = tmp_path / "step_2" / "actor"
    adapted.save_pretrained(adapter)  # no tokenizer here: the base's is used
    merged = tmp_path / "merged"
    adapted.merge_and_unload().save_pretrained(merged)
    build_char_tokenizer().save_pretrained(merged)
    common = ["--task", "reverse_text", "--prompts", prompts, "--max-new-tokens", 6, "--reference", a]
    over_base = _evaluate(capsys, adapter, "--base", a, *common)["splits"]["prompts"]
    exported = _evaluate(capsys, merged, *common)["splits"]["prompts"]
    for key in ("greedy", "sampled"):
        assert [e[key] for e in over_base["examples"]] == [e[key] for e in exported["examples"]]
    assert over_base["gold"] == pytest.approx(exported["gold"])
    assert over_base["kl_to_reference"] == pytest.approx(exported["kl_to_reference"], abs=1e-4)
    # the adapter changed the model (init_lora_weights=False): it is not the base
    assert abs(over_base["kl_to_reference"]) > 1e-3
