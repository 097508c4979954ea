"""Training settings that would make a run silently learn less or nothing are refused at load: exit
2, one line naming the key and a value that works. Their legitimate neighbours still load."""

from pathlib import Path

import pytest

from openaligner.cli.main import command, main
from openaligner.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
REQUIRED = {
    "train-ppo": ["data.train_path=x.jsonl"],
    "train-sft": ["data.train_path=x.jsonl"],
    "train-rm": ["data.train_path=x.jsonl"],
    "serve-critic": ["model.tiny=gpt2"],
    "serve-reward": [],
}


def load(cmd: str, *overrides: str):
    yaml = CONFIGS / f"{cmd.replace('-', '_')}.yaml"
    return load_config(command(cmd).SCHEMA, yaml, [*REQUIRED[cmd], *overrides])


def assert_refused(capsys, cmd: str, overrides: list[str], *needles: str) -> None:
    """``openaligner cmd`` exits 2 at load with one line that holds each of ``needles``."""
    if cmd.startswith("serve-"):  # through load_config: a server that is not refused would serve
        with pytest.raises(ConfigError) as refused:
            load(cmd, *overrides)
        message = str(refused.value)
        assert len(message.splitlines()) == 1, message
        assert all(needle in message for needle in needles), message
        return
    yaml = CONFIGS / f"{cmd.replace('-', '_')}.yaml"
    assert main([cmd, str(yaml), *REQUIRED[cmd], *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


# ---------------------------------------------------------------- train-ppo: the loop
@pytest.mark.parametrize("steps", ["0", "-2"])
def test_ppo_max_steps_that_run_no_step_or_mean_nothing_are_refused(capsys, steps):
    # 0 ran no PPO step and exported the SFT policy as if trained; -2 silently meant -1
    assert_refused(capsys, "train-ppo", [f"trainer.max_steps={steps}"], "trainer.max_steps", "-1")


def test_ppo_max_steps_minus_one_and_positive_load():
    assert load("train-ppo", "trainer.max_steps=-1").trainer.max_steps == -1
    assert load("train-ppo", "trainer.max_steps=1").trainer.max_steps == 1


def test_ppo_negative_gradient_clip_val_is_refused(capsys):
    # a negative norm silently turned clipping off (0 is the documented way); sft, rm and the
    # critic already refused it
    assert_refused(capsys, "train-ppo", ["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", "0")
    assert load("train-ppo", "trainer.gradient_clip_val=0").trainer.gradient_clip_val == 0


@pytest.mark.parametrize("clip", ["0", "-1"])
def test_ppo_score_clip_that_makes_every_score_equal_is_refused(capsys, clip):
    # clamp(s, -c, c) with c <= 0 gives every response the same score: no reward signal at all
    assert_refused(capsys, "train-ppo", [f"trainer.score_clip={clip}"], "trainer.score_clip", "null")
    assert load("train-ppo", "trainer.score_clip=0.5").trainer.score_clip == 0.5


# ---------------------------------------------------------------- train-ppo: responses
@pytest.mark.parametrize(
    "extra",
    [[], ["trainer.gate_unfinished=false", "trainer.missing_eos_penalty=-1"]],
    ids=["gate", "penalty"],
)
def test_ppo_min_length_that_lets_no_response_end_is_refused_when_unfinished_ones_learn_nothing(
    capsys, extra
):
    # stop ids are banned before min_length tokens: at min_length = max_length no response ends, so
    # gate_unfinished gives none a policy gradient, and missing_eos_penalty gives all the same score
    over = ["trainer.length.max_length=8", "trainer.length.min_length=8", *extra]
    assert_refused(capsys, "train-ppo", over, "trainer.length.min_length", "7")


def test_ppo_fixed_length_responses_load_when_unfinished_ones_are_trained_on():
    cfg = load(
        "train-ppo",
        "trainer.length.max_length=8",
        "trainer.length.min_length=8",
        "trainer.gate_unfinished=false",
    )
    assert cfg.trainer.length.min_length == cfg.trainer.length.max_length == 8
    assert load(
        "train-ppo", "trainer.length.max_length=8", "trainer.length.min_length=7"
    ).trainer.gate_unfinished


# ---------------------------------------------------------------- train-ppo: advantages
ONE_RESPONSE = [
    "trainer.num_rollout_samples=1",
    "trainer.rollout_micro_batch_size=1",
    "trainer.global_batch_size=1",
    "trainer.micro_batch_size=1",
]


@pytest.mark.parametrize(
    ("estimator", "key"),
    [("gae", "trainer.normalize_advantages"), ("reinforce_pp", "trainer.num_rollout_samples")],
)
def test_whitening_the_advantages_of_one_response_per_step_is_refused(capsys, estimator, key):
    # whitened over its own tokens, one response loses its mean advantage and so its reward
    # (REINFORCE++ without KL: every token's return is the score, all advantages become 0)
    over = [*ONE_RESPONSE, f"trainer.advantage_estimator={estimator}"]
    assert_refused(capsys, "train-ppo", over, key, "num_rollout_samples")


def test_one_response_per_step_loads_without_whitening():
    cfg = load("train-ppo", *ONE_RESPONSE, "trainer.normalize_advantages=false")
    assert cfg.trainer.rollout_rows == 1
    assert load("train-ppo", *ONE_RESPONSE[1:], "trainer.num_rollout_samples=2").trainer.rollout_rows == 2


# ---------------------------------------------------------------- the learning-rate schedule
def test_serve_critic_refuses_a_warmup_that_outlasts_the_decay(capsys):
    # the rate would fall from its peak straight to min_lr, the decay never running
    assert_refused(
        capsys, "serve-critic", ["optim.warmup_steps=10000"], "optim.warmup_steps", "decay_steps=10000"
    )
    assert (
        load("serve-critic", "optim.warmup_steps=10000", "optim.scheduler=constant").optim.warmup_steps
        == 10000
    )


@pytest.mark.parametrize("cmd", ["train-sft", "train-rm"])
def test_supervised_refuses_a_warmup_as_long_as_max_steps(capsys, cmd):
    assert_refused(
        capsys, cmd, ["trainer.max_steps=10", "optim.warmup_steps=10"], "optim.warmup_steps", "< 10"
    )
    assert load(cmd, "trainer.max_steps=10", "optim.warmup_steps=9").optim.warmup_steps == 9


def test_the_demo_warms_up_for_less_than_a_short_run(tmp_path):
    from openaligner.cli.demo.presets import rm_overrides, sft_overrides

    assert "optim.warmup_steps=20" in sft_overrides(tmp_path, 0, 800)  # the presets' values
    assert "optim.warmup_steps=10" in rm_overrides(tmp_path, 0, 200)
    assert "optim.warmup_steps=0" in sft_overrides(tmp_path, 0, 5)
    assert "optim.warmup_steps=1" in rm_overrides(tmp_path, 0, 10)


@pytest.mark.parametrize(
    "key", ["forward_micro_batch_size", "val_rollout_micro_batch_size", "num_val_samples"]
)
@pytest.mark.parametrize("value", ["0", "-4"])
def test_ppo_optional_sizes_below_one_are_refused(capsys, key, value):
    # 0 silently meant the default (`x or default`), or divided by zero once the run started
    assert_refused(capsys, "train-ppo", [f"trainer.{key}={value}"], f"trainer.{key}", "null")
    assert getattr(load("train-ppo", f"trainer.{key}=8").trainer, key) == 8


# ---------------------------------------------------------------- train-sft / train-rm
@pytest.mark.parametrize("cmd", ["train-sft", "train-rm"])
@pytest.mark.parametrize(
    ("setting", "says"),
    [
        # a traceback once the data was read
        ("data.val_fraction=1.0", "[0, 1)"),
        ("data.val_fraction=-0.1", "[0, 1)"),
        # every example dropped as too long, blamed on the data
        ("data.max_length=-3", "0 = the model's position limit"),
        # a traceback at the first validation, after training
        ("trainer.val_micro_batch_size=0", ">= 1"),
        # silently only at the end, as 0 is documented to mean (or, for log_interval, undocumented)
        ("trainer.log_interval=0", ">= 1"),
        ("trainer.val_check_interval=-1", ">= 0"),
        ("trainer.save_interval=-5", ">= 0"),
    ],
)
def test_supervised_loop_and_data_values_that_mean_nothing_are_refused(capsys, cmd, setting, says):
    assert_refused(capsys, cmd, [setting], setting.split("=")[0], says)


# ---------------------------------------------------------------- serve-reward: the reward's weights
MODEL, FUNCTION = "model.tiny=gpt2", "reward.function=rewards.py:score"


@pytest.mark.parametrize(
    ("served", "weight", "says"),
    [
        # a model alone answers its score as it is: the weights were silently ignored
        ([MODEL], "reward.model_weight=2", "without reward.function"),
        ([MODEL], "reward.function_weight=0.5", "without reward.function"),
        # the function alone: every reward 0; or its weight on a model that is not there, ignored
        ([FUNCTION], "reward.function_weight=0", "reward.function=null"),
        ([FUNCTION], "reward.model_weight=0.5", "no reward model"),
        # both: the model, or the function, loaded and called to be ignored
        ([MODEL, FUNCTION], "reward.model_weight=0", "serve the function alone"),
        ([MODEL, FUNCTION], "reward.function_weight=0", "reward.function=null"),
    ],
)
def test_reward_weights_that_do_nothing_or_silence_the_reward_are_refused(capsys, served, weight, says):
    assert_refused(capsys, "serve-reward", [*served, weight], weight.split("=")[0], says)


def test_reward_weights_that_mix_a_model_and_a_function_load():
    cfg = load("serve-reward", MODEL, FUNCTION, "reward.model_weight=0.5", "reward.function_weight=-2")
    assert (cfg.reward.model_weight, cfg.reward.function_weight) == (0.5, -2)
    assert load("serve-reward", FUNCTION, "reward.function_weight=3").reward.function_weight == 3


def test_rm_refuses_the_same_field_as_chosen_and_rejected(capsys):
    # every pair would compare a response with itself: margin 0 for any weights, gradient exactly 0
    over = ["data.chosen_key=response", "data.rejected_key=response"]
    assert_refused(capsys, "train-rm", over, "data.rejected_key", "data.chosen_key")
    assert load("train-rm", "data.chosen_key=good", "data.rejected_key=bad").data.rejected_key == "bad"


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_k1_as_a_kl_loss_term_is_refused(capsys, estimator):
    # ∇ β·(log π − log π_ref) = β·∇log π, whose expectation over the sampled tokens is 0: the
    # penalty would pull nothing toward the initial policy
    over = [f"trainer.advantage_estimator={estimator}", "trainer.kl_in=loss", "trainer.kl_estimator=k1"]
    assert_refused(capsys, "train-ppo", over, "trainer.kl_estimator", "k3")


def test_k1_in_the_reward_and_k2_k3_abs_in_the_loss_load():
    assert load("train-ppo", "trainer.kl_estimator=k1").trainer.kl_kind == "k1"  # kl_in=reward
    for kind in ("k2", "k3", "abs"):
        cfg = load("train-ppo", "trainer.kl_in=loss", f"trainer.kl_estimator={kind}")
        assert cfg.trainer.kl_kind == kind


def test_ppo_max_time_per_run_of_zero_is_refused(capsys):
    # checked after each step: a zero limit ran one step, then saved and stopped as if done
    assert_refused(capsys, "train-ppo", ["trainer.max_time_per_run=00:00:00:00"], "trainer.max_time_per_run")
    assert load("train-ppo", "trainer.max_time_per_run=00:00:00:01").trainer.max_time_per_run == "00:00:00:01"


# ---------------------------------------------------------------- LoRA
@pytest.mark.parametrize("cmd", ["train-ppo", "serve-critic"])
def test_lora_dropout_where_the_model_trains_in_eval_mode_is_refused(capsys, cmd):
    # the PPO actor and the critic train in eval mode (their log-probs and values must match what
    # inference computed), so adapter dropout never applied
    over = ["lora.r=4", "lora.dropout=0.1"]
    assert_refused(capsys, cmd, over, "lora.dropout", "0")
    assert load(cmd, "lora.r=4", "lora.dropout=0").lora.r == 4


def test_lora_dropout_trains_in_sft():
    assert load("train-sft", "lora.r=4", "lora.dropout=0.1").lora.dropout == 0.1


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("trainer.micro_batch_size=5", "global_batch_size=16"),
        ("trainer.rollout_micro_batch_size=5", "n_samples_per_prompt=64"),
        ("trainer.val_rollout_micro_batch_size=5", "num_val_samples=64"),
    ],
)
def test_ppo_micro_batches_that_do_not_split_their_batch_are_refused_at_load(capsys, setting, says):
    # refused before only once the models were loaded and the servers reached, with a traceback
    assert_refused(capsys, "train-ppo", [setting], setting.split("=")[0], says)
