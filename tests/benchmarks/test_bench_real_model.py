"""benchmarks/bench_real_model.py: the train-ppo command of each run is a valid configuration with
the settings its options name (LoRA merged on save, or every weight with --full), and the report
names the mode and summarises long runs' step times; --train-words makes the train prompts of
other words and leaves both held-out splits as they were."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_real_model import result_name, run_name, table, train_command, write_data
from openaligner.cli import train_ppo
from openaligner.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def options(
    full: bool, model: Path = Path("gemma"), tag: str = "", settings: tuple = ()
) -> argparse.Namespace:
    return argparse.Namespace(
        model=model,
        steps=40,
        lr=1e-5,
        beta=0.05,
        max_time="00:00:25:00",
        full=full,
        tag=tag,
        set=list(settings),
        spelled=False,
    )


def a_model(tmp_path: Path) -> Path:
    """What the configuration checks of a model directory: that it is one."""
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gemma3_text"}')
    return model


def config_of(cmd: list[str]):
    at = cmd.index("train-ppo")
    assert Path(cmd[at + 1]) == ROOT / "configs" / "train_ppo.yaml"
    return load_config(train_ppo.SCHEMA, cmd[at + 1], cmd[at + 2 :])


def test_a_lora_run_trains_merged_adapters_and_a_full_run_every_weight(tmp_path):
    remote = ["remote.combine_rm_and_critic_server=false", "remote.reward_model.port=5555"]
    model = a_model(tmp_path)
    lora = config_of(train_command(options(False, model), tmp_path / "grpo-seed0", "grpo", 0, remote))
    full = config_of(train_command(options(True, model), tmp_path / "grpo-full-seed0", "grpo", 0, remote))
    assert lora.lora.r == 16 and lora.lora.merge_on_save
    assert full.lora.r == 0  # no adapters: the optimizer holds every weight of the actor
    for cfg in (lora, full):
        assert cfg.trainer.advantage_estimator == "grpo" and cfg.trainer.n_samples_per_prompt == 4
        assert cfg.trainer.max_steps == 40 and cfg.trainer.val_check_interval == 10
        assert cfg.optim.lr == 1e-5 and cfg.remote.reward_model.port == 5555
    ppo = config_of(train_command(options(False, model), tmp_path, "ppo", 1, remote))
    assert ppo.trainer.advantage_estimator == "gae" and ppo.trainer.num_rollout_samples == 8
    assert ppo.trainer.seed == 1
    assert (run_name(options(True), "ppo", 1), run_name(options(False), "ppo", 1)) == (
        "ppo-full-seed1",
        "ppo-seed1",
    )
    # a finished run's result leads the report back to its directory (curves), either mode
    for full in (True, False):
        mode = {"algorithm": "ppo", "seed": 1, "mode": "full" if full else "LoRA"}
        assert result_name(mode) == run_name(options(full), "ppo", 1)
    # --set reaches train-ppo (after the script's own settings: it wins), --tag names the run
    warm = options(False, model, tag="warm5", settings=("trainer.critic_warmup_steps=5",))
    assert config_of(train_command(warm, tmp_path, "ppo", 1, remote)).trainer.critic_warmup_steps == 5
    assert run_name(warm, "ppo", 1) == "ppo-warm5-seed1"
    assert result_name({"algorithm": "ppo", "seed": 1, "mode": "LoRA", "tag": "warm5"}) == "ppo-warm5-seed1"


def test_the_table_names_the_mode_and_summarises_a_long_runs_step_times():
    scores = {"gold": 0.25, "gold_greedy": 0.27, "kl_to_start": 0.0}
    common = {
        "seed": 0,
        "start": scores,
        "end": {**scores, "gold": 0.4, "kl_to_start": 2.0},
        "tokens_per_s": 20.0,
        "train_wall_s": 600.0,
        "trainer_peak_rss_mib": 3072.0,
        "server_peak_rss_mib": {"serve_reward": 380.0},
    }
    short = {
        **common,
        "algorithm": "grpo",
        "mode": "LoRA",
        "steps": 2,
        "step_s": [12.0, 14.0],
        "step_s_median": 14.0,
    }
    long = {
        **common,
        "algorithm": "grpo",
        "mode": "full",
        "steps": 40,
        "step_s": [10.0 + i % 7 for i in range(40)],
        "step_s_median": 13.0,
    }
    # measured with the exact rates and the unseen-words split
    unseen = {"gold_greedy": 0.31, "exact_greedy": 0.0, "exact": 0.0}
    start = {**scores, "exact_greedy": 0.0, "exact": 0.0, "splits": {"unseen": unseen}}
    end = {**start, "exact_greedy": 0.25, "exact": 0.125, "kl_to_start": 1.0,
           "splits": {"unseen": {**unseen, "gold_greedy": 0.62, "exact_greedy": 0.1}}}  # fmt: skip
    exact = {**short, "start": start, "end": end}
    rows = table([short, long, exact]).splitlines()
    assert rows[2].startswith("| GRPO (LoRA) | 0 | 2 |") and "| 12, 14 s |" in rows[2]
    assert rows[3].startswith("| GRPO (full) | 0 | 40 |") and "| median 13 s (10–16) |" in rows[3]
    assert "0.250 → **0.400**" in rows[3]
    assert "| n/a → n/a | n/a → n/a | n/a → n/a |" in rows[3]  # measured before the exact rate was
    assert "| 0 % / 0 % → 25 % / 12 % | 0.310 → 0.620 | 0 % / 0 % → 10 % / 0 % |" in rows[4]


def test_train_words_change_the_train_prompts_only(tmp_path):
    from openaligner.tasks.reverse_text import WORDS, parse_prompt

    vocab = [f"zq{a}{b}x" for a in "abcdefgh" for b in "ijklmnop"]
    (tmp_path / "words.json").write_text(json.dumps(vocab))
    write_data(tmp_path / "task", 0, 8)
    write_data(tmp_path / "other", 0, 8, tmp_path / "words.json")

    def texts(run: str, split: str) -> list[str]:
        lines = (tmp_path / run / f"{split}.jsonl").read_text().splitlines()
        return [parse_prompt(json.loads(line)["prompt"]) for line in lines]

    assert all(set(t.split()) <= set(vocab) for t in texts("other", "train"))
    assert all(set(t.split()) <= set(WORDS) for t in texts("task", "train"))
    for split in ("heldout", "unseen"):
        assert texts("other", split) == texts("task", split)


def test_spelled_runs_write_spelled_prompts_of_the_same_texts_and_let_responses_end_at_eos(tmp_path):
    from openaligner.tasks.reverse_text import is_spelled, parse_prompt

    write_data(tmp_path / "plain", 0, 8)
    write_data(tmp_path / "spelled", 0, 8, spelled=True)
    for split in ("train", "heldout", "unseen"):
        plain, spelled = (
            [json.loads(line)["prompt"] for line in (tmp_path / run / f"{split}.jsonl").open()]
            for run in ("plain", "spelled")
        )
        assert [parse_prompt(p) for p in plain] == [parse_prompt(p) for p in spelled]
        assert all(is_spelled(p) for p in spelled) and not any(is_spelled(p) for p in plain)
    remote = ["remote.combine_rm_and_critic_server=false", "remote.reward_model.port=5555"]
    args = options(False, a_model(tmp_path))
    plain_cfg = config_of(train_command(args, tmp_path, "grpo", 0, remote))
    args.spelled = True
    spelled_cfg = config_of(train_command(args, tmp_path, "grpo", 0, remote))
    assert list(plain_cfg.trainer.sampling.end_strings) == ["\n"]
    assert list(spelled_cfg.trainer.sampling.end_strings) == []  # a line break is not the answer's end
    assert spelled_cfg.trainer.length.max_length > plain_cfg.trainer.length.max_length
    assert spelled_cfg.data.seq_length >= spelled_cfg.trainer.length.max_length + 25
