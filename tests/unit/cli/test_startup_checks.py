"""Runs that cannot work are refused at start-up: one paragraph on stderr naming the user's key, the
value and the fix, exit code 2, no traceback — before a model loads or a server is contacted
where the check allows it.

Every case goes through ``openaligner.cli.main.main`` in-process with the tiny built-in model.
train-ppo points at a closed port with a short ``remote.init_timeout_s``, so a run that is not
refused fails fast (exit 1) instead of waiting for a server.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from openaligner.cli.main import main


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_jsonl(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def refused(capsys: pytest.CaptureFixture[str], command: str, *args: str) -> str:
    """Run ``openaligner command args``; assert the one-paragraph refusal and return it."""
    code = main([command, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"openaligner {command}: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------- train-ppo
@pytest.fixture
def ppo_args(tmp_path: Path) -> list[str]:
    """A tiny train-ppo run that would start: 8 short prompts, rollout batches of 4."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(8)])
    return [
        f"data.train_path={prompts}",
        "device=cpu",
        f"exp.output_dir={tmp_path / 'run'}",
        "exp.tensorboard=false",
        "exp.progress=false",
        "trainer.num_rollout_samples=4",
        "trainer.rollout_micro_batch_size=4",
        "trainer.global_batch_size=4",
        "trainer.max_steps=1",
        f"remote.critic.port={closed_port()}",
        "remote.init_timeout_s=0.5",
    ]


def test_ppo_refuses_a_missing_prompt_file(capsys, ppo_args, tmp_path):
    missing = tmp_path / "nope.jsonl"
    line = refused(capsys, "train-ppo", *ppo_args, f"data.train_path={missing}")
    assert "data.train_path" in line and str(missing) in line and "does not exist" in line


def test_ppo_refuses_an_empty_prompt_file(capsys, ppo_args, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    line = refused(capsys, "train-ppo", *ppo_args, f"data.train_path={empty}")
    assert "data.train_path" in line and "empty" in line


def test_ppo_refuses_an_empty_validation_file(capsys, ppo_args, tmp_path):
    empty = tmp_path / "val.jsonl"
    empty.write_text("")
    line = refused(capsys, "train-ppo", *ppo_args, f"data.val_path={empty}")
    assert "data.val_path" in line and "empty" in line


def test_ppo_refuses_an_unreadable_prompt_file(capsys, ppo_args, tmp_path):
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    line = refused(capsys, "train-ppo", *ppo_args, f"data.train_path={binary}")
    assert "data.train_path" in line and "cannot be read" in line


def test_ppo_refuses_a_prompt_file_with_a_bad_line(capsys, ppo_args, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"text": "b"}])
    line = refused(capsys, "train-ppo", *ppo_args, f"data.train_path={bad}")
    assert "data.train_path" in line and "bad.jsonl:2" in line and "prompt" in line


def test_ppo_refuses_a_chat_template_the_tokenizer_does_not_have(capsys, ppo_args):
    line = refused(capsys, "train-ppo", *ppo_args, "data.chat_template=true")
    assert "data.chat_template=true but the built-in tokenizer has no chat template" in line


def test_ppo_refuses_conversations_without_a_chat_template(capsys, ppo_args, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "p"}]}] * 8)
    line = refused(capsys, "train-ppo", *ppo_args, f"data.train_path={chat}")
    assert f"{chat}:1: a conversation (messages) needs a chat template" in line


def test_ppo_refuses_when_every_prompt_is_too_long(capsys, ppo_args, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 40}] * 8)
    line = refused(
        capsys,
        "train-ppo",
        *ppo_args,
        f"data.train_path={long}",
        "data.seq_length=64",
        "trainer.length.max_length=32",
    )
    # 64 - 32 = 32 prompt tokens; each prompt is BOS + 40 characters
    assert "all 8 prompts" in line and "32 tokens" in line
    assert "data.seq_length" in line and "trainer.length.max_length" in line


def test_ppo_refuses_fewer_prompts_than_one_rollout_batch(capsys, ppo_args):
    line = refused(
        capsys, "train-ppo", *ppo_args, "trainer.num_rollout_samples=16", "trainer.global_batch_size=16"
    )
    assert "8 prompts" in line and "trainer.num_rollout_samples=16" in line


def test_ppo_counts_dropped_prompts_when_too_few_remain(capsys, ppo_args, tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "short"}] * 3 + [{"prompt": "x" * 300}] * 5)
    line = refused(capsys, "train-ppo", *ppo_args, f"data.train_path={mixed}")
    assert "3 prompts" in line and "5 were dropped" in line and "trainer.num_rollout_samples=4" in line


def test_ppo_refuses_fewer_validation_prompts_than_one_validation_batch(capsys, ppo_args, tmp_path):
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "v"}] * 2)
    line = refused(capsys, "train-ppo", *ppo_args, f"data.val_path={val}")
    assert "data.val_path" in line and "2 prompts" in line and "trainer.num_val_samples" in line


def test_ppo_refuses_fewer_validation_prompts_when_long_ones_are_dropped(capsys, ppo_args, tmp_path):
    # the first num_val_samples prompts of the file include a dropped one: 3 usable, 4 needed
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "x" * 300}] + [{"prompt": "v"}] * 3)
    line = refused(capsys, "train-ppo", *ppo_args, f"data.val_path={val}")
    assert "data.val_path" in line and "3 prompts" in line and "trainer.num_val_samples" in line


def test_ppo_validation_off_needs_no_validation_batch(capsys, ppo_args, tmp_path):
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "v"}] * 2)
    code = main(
        [
            "train-ppo",
            *ppo_args,
            f"data.val_path={val}",
            "trainer.val_check_interval=0",
            "trainer.save_interval=0",
        ]
    )
    # not refused at start-up: it gets as far as the (closed) critic port
    assert code == 1, capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_ppo_refuses_seq_length_beyond_the_tiny_models_positions(capsys, ppo_args, arch):
    line = refused(capsys, "train-ppo", *ppo_args, f"actor.tiny={arch}", "actor.tiny_max_positions=128")
    assert "data.seq_length=256" in line and "128" in line and "actor.tiny_max_positions" in line


@pytest.mark.parametrize(
    ("key", "make_config"),
    [("n_positions", "gpt2"), ("max_position_embeddings", "llama")],
)
def test_ppo_refuses_seq_length_beyond_a_model_directory_before_loading_weights(
    capsys, ppo_args, tmp_path, key, make_config
):
    from transformers import GPT2Config, LlamaConfig

    config = GPT2Config(n_positions=64) if make_config == "gpt2" else LlamaConfig(max_position_embeddings=64)
    config.save_pretrained(tmp_path / "model")  # config.json only: loading weights would fail differently
    line = refused(capsys, "train-ppo", *ppo_args, f"actor.path={tmp_path / 'model'}")
    assert "data.seq_length=256" in line and "64 positions" in line and "actor.path" in line


@pytest.mark.parametrize("lr", ["0", "-1e-5"])
def test_ppo_refuses_a_learning_rate_that_is_not_positive(capsys, ppo_args, lr):
    line = refused(capsys, "train-ppo", *ppo_args, f"optim.lr={lr}")
    assert "optim.lr" in line and "> 0" in line


@pytest.mark.parametrize(
    ("schedule", "says"),
    [
        # 1 PPO step of 1 optimizer step: the rate would never leave the warm-up
        (["optim.warmup_steps=1"], "optim.warmup_steps=1 is not shorter than the run's 1 optimizer steps"),
        # 2 epochs × 2 steps: the decay to 0 would end half way
        (
            ["trainer.max_steps=-1", "trainer.max_epochs=2", "optim.scheduler=linear", "optim.decay_steps=2"],
            "the last 2 would train at learning rate 0",
        ),
    ],
)
def test_ppo_refuses_a_schedule_that_does_not_fit_the_run_before_loading_the_actor(
    capsys, ppo_args, schedule, says, monkeypatch
):
    import openaligner.trainer.ppo_recipe as recipe

    monkeypatch.setattr(recipe, "build_trainable_model", None)  # refused before any model is built
    assert says in refused(capsys, "train-ppo", *ppo_args, *schedule)


def test_ppo_refuses_a_critic_warmup_that_leaves_the_actor_no_step(capsys, ppo_args, monkeypatch):
    import openaligner.trainer.ppo_recipe as recipe

    monkeypatch.setattr(recipe, "build_trainable_model", None)  # refused before any model is built
    # 8 prompts in rollouts of 4: one epoch is 2 rollouts, both taken by the critic's warm-up
    by_epochs = ["trainer.max_steps=-1", "trainer.max_epochs=1", "trainer.critic_warmup_steps=2"]
    line = refused(capsys, "train-ppo", *ppo_args, *by_epochs)
    assert "trainer.critic_warmup_steps=2 takes all 2 rollouts" in line and "trainer.max_epochs" in line


def test_ppo_names_the_actor_key_for_a_bad_actor_path(capsys, ppo_args, tmp_path):
    line = refused(capsys, "train-ppo", *ppo_args, f"actor.path={tmp_path}")
    assert f"actor.path='{tmp_path}'" in line and "model.path" not in line


def test_ppo_names_the_actor_key_for_a_bad_tiny_architecture(capsys, ppo_args):
    line = refused(capsys, "train-ppo", *ppo_args, "actor.tiny=bert")
    assert "actor.tiny" in line and "actor.path" in line and "model." not in line


def test_ppo_names_the_actor_key_when_the_actor_has_no_tokenizer(capsys, ppo_args, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_positions=1024).save_pretrained(tmp_path / "model")
    line = refused(capsys, "train-ppo", *ppo_args, f"actor.path={tmp_path / 'model'}")
    assert "actor.path" in line and "tokenizer.path" in line and "model.path" not in line


# ------------------------------------------------------------------------------- train-sft / train-rm
SFT_RECORD = {"prompt": "ab", "response": "cd"}
RM_RECORD = {"prompt": "ab", "chosen": "cd", "rejected": "ef"}


@pytest.fixture(params=["train-sft", "train-rm"])
def supervised(request, tmp_path: Path) -> tuple[str, list[str], dict[str, str]]:
    """(command, args of a tiny run that would start, one valid record)."""
    record = SFT_RECORD if request.param == "train-sft" else RM_RECORD
    data = write_jsonl(tmp_path / "train.jsonl", [record] * 8)
    args = [
        f"data.train_path={data}",
        "data.val_fraction=0",
        "device=cpu",
        f"output_dir={tmp_path / 'run'}",
        "progress=false",
        "trainer.max_steps=1",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4",
    ]
    return request.param, args, record


def test_supervised_refuses_a_missing_data_file(capsys, supervised, tmp_path):
    command, args, _ = supervised
    line = refused(capsys, command, *args, f"data.train_path={tmp_path / 'nope.jsonl'}")
    assert "data.train_path" in line and "does not exist" in line


def test_supervised_refuses_a_directory_that_is_no_datasets_directory(capsys, supervised, tmp_path):
    command, args, _ = supervised
    line = refused(capsys, command, *args, f"data.train_path={tmp_path}")
    assert "data.train_path" in line and "datasets" in line


def test_supervised_refuses_a_chat_template_the_tokenizer_does_not_have(capsys, supervised):
    command, args, _ = supervised
    line = refused(capsys, command, *args, "data.chat_template=true")
    assert "data.chat_template=true but the built-in tokenizer has no chat template" in line


def test_supervised_refuses_conversations_without_a_chat_template(capsys, supervised, tmp_path):
    command, args, _ = supervised
    conversation = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    record = (
        {"messages": conversation}
        if command == "train-sft"
        else {"chosen": conversation, "rejected": conversation}
    )
    chat = write_jsonl(tmp_path / "chat.jsonl", [record] * 8)
    line = refused(capsys, command, *args, f"data.train_path={chat}")
    assert f"{chat}:1: a conversation (messages) needs a chat template" in line


def test_supervised_names_the_record_and_the_shape_of_a_malformed_record(capsys, supervised, tmp_path):
    command, args, record = supervised
    bad = write_jsonl(tmp_path / "bad.jsonl", [record, {"prompt": "ab"}])
    line = refused(capsys, command, *args, f"data.train_path={bad}")
    assert f"{bad}:2: missing field" in line and "expected {" in line


def test_supervised_refuses_an_empty_validation_file(capsys, supervised, tmp_path):
    command, args, _ = supervised
    (tmp_path / "val.jsonl").write_text(" \n")
    line = refused(capsys, command, *args, f"data.val_path={tmp_path / 'val.jsonl'}")
    assert "data.val_path" in line and "empty" in line


def test_supervised_refuses_a_data_file_with_a_bad_line(capsys, supervised, tmp_path):
    command, args, record = supervised
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record) + "\nnot json\n")
    line = refused(capsys, command, *args, f"data.train_path={bad}")
    assert "data.train_path" in line and "bad.jsonl:2" in line


def test_supervised_refuses_fewer_examples_than_one_global_batch(capsys, supervised):
    command, args, _ = supervised
    line = refused(capsys, command, *args, "trainer.global_batch_size=16", "trainer.micro_batch_size=16")
    assert "8" in line and "trainer.global_batch_size=16" in line


def test_supervised_refuses_when_every_example_is_too_long(capsys, supervised):
    command, args, _ = supervised
    line = refused(capsys, command, *args, "data.max_length=3")
    assert "all 8" in line and "data.max_length=3" in line


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_supervised_refuses_max_length_beyond_the_models_positions(capsys, supervised, arch):
    command, args, _ = supervised
    line = refused(
        capsys, command, *args, f"model.tiny={arch}", "model.tiny_max_positions=32", "data.max_length=64"
    )
    assert "data.max_length=64" in line and "32" in line and "model.tiny_max_positions" in line


def test_supervised_refuses_max_length_beyond_a_model_directory_before_loading_weights(
    capsys, supervised, tmp_path
):
    from transformers import GPT2Config

    command, args, _ = supervised
    GPT2Config(n_positions=32).save_pretrained(tmp_path / "model")
    line = refused(capsys, command, *args, f"model.path={tmp_path / 'model'}", "data.max_length=64")
    assert "data.max_length=64" in line and "32 positions" in line and "model.path" in line


def test_supervised_needs_max_length_for_a_model_without_a_position_limit(capsys, supervised, tmp_path):
    command, args, _ = supervised
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    line = refused(capsys, command, *args, f"model.path={tmp_path / 'model'}")
    assert "data.max_length" in line and "no position limit" in line


@pytest.mark.parametrize("lr", ["0", "-1"])
def test_supervised_refuses_a_learning_rate_that_is_not_positive(capsys, supervised, lr):
    command, args, _ = supervised
    line = refused(capsys, command, *args, f"optim.lr={lr}")
    assert "optim.lr" in line


def test_supervised_refuses_a_warmup_as_long_as_the_run(capsys, supervised):
    command, args, _ = supervised
    # at load when trainer.max_steps says the run's length; once the data is read when it is -1
    line = refused(capsys, command, *args, "optim.warmup_steps=1")
    assert "optim.warmup_steps=1 is not shorter than trainer.max_steps=1" in line
    line = refused(
        capsys, command, *args, "trainer.max_steps=-1", "trainer.max_epochs=1", "optim.warmup_steps=2"
    )
    assert "optim.warmup_steps=2 is not shorter than the run's 2 optimizer steps" in line


def test_supervised_still_names_the_model_key(capsys, supervised, tmp_path):
    command, args, _ = supervised
    line = refused(capsys, command, *args, f"model.path={tmp_path}")
    assert f"model.path='{tmp_path}'" in line


# ------------------------------------------------------------------------------- serve-critic / -reward
def test_servers_refuse_max_sequence_length_beyond_the_models_positions():
    # The function serve-reward and serve-critic call once the model is loaded (a run of the command
    # that is not refused would serve until stopped, so the test calls it directly).
    from openaligner.cli.serving import sequence_limit
    from openaligner.config import StartupError

    with pytest.raises(
        StartupError, match=r"server\.max_sequence_length=1000 is beyond the model's 256 positions"
    ):
        sequence_limit(1000, [256, None])
    with pytest.raises(StartupError, match="128 positions"):
        sequence_limit(200, [256, 128])  # serve-critic: the critic's and the reward model's
    assert sequence_limit(None, [256, 128]) == 128
    assert sequence_limit(100, [None]) == 100
    assert sequence_limit(None, [None]) is None


@pytest.mark.parametrize("command", ["serve-reward", "serve-critic"])
@pytest.mark.parametrize(
    "args,says",
    [
        ((), "no model to serve: set model.path=<HF directory> or model.tiny=gpt2"),  # never a random one
        (("model.tiny=true",), "model.tiny=true is now model.tiny=gpt2"),
        (("model.tiny=gpt2", "model.seed=1"), "model.seed is now model.tiny_seed"),
        (("model.tokenizer_path=/tok",), "model.tokenizer_path is now tokenizer.path"),
    ],
)
def test_servers_refuse_to_start_without_a_named_model_or_with_old_keys(capsys, command, args, says):
    assert refused(capsys, command, *args).startswith(f"openaligner {command}: {says}")


@pytest.mark.parametrize("command", ["serve-reward", "serve-critic"])
def test_servers_refuse_a_max_batch_size_below_the_preferred_batch_size(capsys, command):
    # Before: serve-critic started Triton, which crashed (glibc "double free or corruption") and
    # timed out two minutes later; serve-reward failed with a traceback naming max_batch_size.
    line = refused(capsys, command, "model.tiny=gpt2", "server.max_batch_size=2")
    assert "server.max_batch_size=2 is below" in line and "server.inference_micro_batch_size=[4]" in line
    assert "set server.max_batch_size=4 or more" in line


@pytest.mark.parametrize("command", ["serve-reward", "serve-critic"])
def test_servers_refuse_a_max_batch_size_below_micro_batch_times_ranks(capsys, monkeypatch, command):
    # Under torchrun the preferred batch is one micro-batch per rank: [4] on 2 ranks prefers 8.
    # Checked before any model loads, so a world size of 2 is all the command needs to be told.
    from openaligner import distributed as dp

    monkeypatch.setattr(dp, "world_size", lambda: 2)
    line = refused(capsys, command, "model.tiny=gpt2", "server.max_batch_size=4")
    assert "server.max_batch_size=4 is below" in line and "x 2 ranks" in line
    assert "set server.max_batch_size=8 or more" in line


def test_the_batching_check_takes_the_number_of_ranks():
    from openaligner.cli.serving import check_batching
    from openaligner.config import StartupError
    from openaligner.servers.critic import CriticServerConfig

    server = CriticServerConfig(inference_micro_batch_size=[2, 4], max_batch_size=8)
    check_batching(server, world_size=2)  # prefers 4 and 8: both fit
    says = r"server\.max_batch_size=8 is below .* 12 .*max_batch_size=12 or more"
    with pytest.raises(StartupError, match=says):
        check_batching(server, world_size=3)


@pytest.mark.parametrize("command", ["serve-reward", "serve-critic"])
@pytest.mark.parametrize(
    "setting,says",
    [
        ("server.max_queue_delay_microseconds=-1", "server.max_queue_delay_microseconds must be >= 0"),
        (f"server.max_batch_size={2**31}", "server.max_batch_size must be in 1..2147483647"),
        ("server.max_batch_size=0", "server.max_batch_size must be in 1..2147483647"),
    ],
)
def test_servers_refuse_batcher_settings_triton_cannot_take(capsys, command, setting, says):
    assert says in refused(capsys, command, "model.tiny=gpt2", setting)


@pytest.mark.parametrize("lr", ["0", "-1e-6"])
def test_serve_critic_refuses_a_learning_rate_that_is_not_positive(capsys, lr):
    line = refused(capsys, "serve-critic", "model.tiny=gpt2", f"optim.lr={lr}")
    assert "optim.lr" in line and "> 0" in line


# ------------------------------------------------------------- a tokenizer past the embeddings: all
@pytest.fixture
def vocab_dirs(tmp_path: Path) -> dict[str, Path]:
    """A 400-id tokenizer (the policy's) and models whose embedding tables have 384 rows (an SFT
    model and a reward model with their own, smaller tokenizer) or 512 (padded past the tokenizer)."""
    from openaligner.models.builders import TinySize, build_tiny_causal_lm, build_tiny_sequence_classifier
    from openaligner.models.reward import RewardModel
    from openaligner.models.tokenizers import build_word_tokenizer

    dirs = {name: tmp_path / name for name in ("tok400", "sft384", "rm384", "sft512")}
    build_word_tokenizer([f"w{i}" for i in range(396)]).save_pretrained(str(dirs["tok400"]))  # + 4 specials

    def size(rows: int) -> TinySize:
        return TinySize(vocab_size=rows, hidden_size=32, num_heads=2)

    build_tiny_causal_lm("gpt2", size(384), seed=0).save_pretrained(str(dirs["sft384"]))
    build_tiny_causal_lm("gpt2", size(512), seed=0).save_pretrained(str(dirs["sft512"]))
    RewardModel(build_tiny_sequence_classifier("gpt2", size(384), seed=0)).save_pretrained(dirs["rm384"])
    return dirs


def embeds_too_few(line: str, key: str) -> bool:
    return f"400 token ids (0..399) but {key} embeds only 384" in line and "ids 384..399" in line


def test_serve_critic_refuses_the_policys_tokenizer_on_a_reward_models_embeddings(capsys, vocab_dirs):
    # Before: the critic started, reading the policy's ids through the reward model's embeddings
    # (and an id from 384 on would have indexed past them).
    line = refused(
        capsys,
        "serve-critic",
        f"model.path={vocab_dirs['rm384']}",
        f"tokenizer.path={vocab_dirs['tok400']}",
        "server.combine_rm_and_critic_server=false",
    )
    assert embeds_too_few(line, "model")
    assert "serve-critic model.path=<the policy's SFT directory>" in line  # what works


def test_serve_critic_refuses_a_combined_reward_model_that_cannot_embed_the_ids(capsys, vocab_dirs):
    # the critic's 512 rows are fine (a table padded past the tokenizer); the reward model's 384 are not
    line = refused(
        capsys,
        "serve-critic",
        f"model.path={vocab_dirs['sft512']}",
        f"tokenizer.path={vocab_dirs['tok400']}",
        f"reward_model.path={vocab_dirs['rm384']}",
    )
    assert embeds_too_few(line, "reward_model") and "serve-reward model.path=<reward model>" in line


def test_serve_reward_refuses_a_tokenizer_past_the_models_embeddings(capsys, vocab_dirs):
    line = refused(
        capsys, "serve-reward", f"model.path={vocab_dirs['rm384']}", f"tokenizer.path={vocab_dirs['tok400']}"
    )
    assert embeds_too_few(line, "model") and "use the tokenizer the model was trained with" in line


def test_trainers_refuse_a_tokenizer_past_the_models_embeddings(capsys, vocab_dirs, ppo_args, supervised):
    command, args, _ = supervised
    model = vocab_dirs["sft384" if command == "train-sft" else "rm384"]
    line = refused(capsys, command, *args, f"model.path={model}", f"tokenizer.path={vocab_dirs['tok400']}")
    assert embeds_too_few(line, "model")
    line = refused(
        capsys,
        "train-ppo",
        *ppo_args,
        f"actor.path={vocab_dirs['sft384']}",
        f"tokenizer.path={vocab_dirs['tok400']}",
    )
    assert embeds_too_few(line, "actor")


# ------------------------------------------------------------------------------------ --print-config
@pytest.mark.parametrize("command", ["train-ppo", "train-sft", "train-rm"])
def test_print_config_shows_missing_mandatory_values(capsys, command):
    assert main([command, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert "train_path: ???" in captured.out
    assert "data.train_path" in captured.err  # told what still needs a value


def test_print_config_still_refuses_a_bad_value(capsys):
    assert main(["train-ppo", "--print-config", "trainer.ppo_epochs=0"]) == 2
    assert "trainer.ppo_epochs" in capsys.readouterr().err
