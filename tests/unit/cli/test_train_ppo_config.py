"""train-ppo's schema refuses bad values by key name."""

from pathlib import Path

import pytest

from openaligner.cli.main import main
from openaligner.cli.train_ppo import SCHEMA
from openaligner.config import ConfigError, load_config

YAML = Path(__file__).resolve().parents[3] / "configs" / "train_ppo.yaml"
REQUIRED = ["data.train_path=x.jsonl"]


def test_server_overlap_threads_is_read_and_checked():
    assert load_config(SCHEMA, YAML, [*REQUIRED]).exp.server_overlap_threads is None
    assert (
        load_config(SCHEMA, YAML, [*REQUIRED, "exp.server_overlap_threads=1"]).exp.server_overlap_threads == 1
    )
    with pytest.raises(ConfigError, match=r"exp\.server_overlap_threads must be >= 1"):
        load_config(SCHEMA, YAML, [*REQUIRED, "exp.server_overlap_threads=0"])


def test_rollout_engine_is_read_and_an_unknown_one_is_refused_in_one_line(tmp_path, capsys):
    assert load_config(SCHEMA, YAML, [*REQUIRED]).rollout.engine == "hf"
    with pytest.raises(ConfigError, match=r"rollout\.engine must be one of hf, vllm, got 'sglang'"):
        load_config(SCHEMA, YAML, [*REQUIRED, "rollout.engine=sglang"])
    assert main(["train-ppo", str(YAML), *REQUIRED, "rollout.engine=sglang"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rollout.engine" in err and "hf" in err and len(err.splitlines()) == 1


def test_logits_chunk_mb_is_read_and_checked():
    assert load_config(SCHEMA, YAML, [*REQUIRED]).trainer.logits_chunk_mb == 256.0
    whole = load_config(SCHEMA, YAML, [*REQUIRED, "trainer.logits_chunk_mb=null"])
    assert whole.trainer.logits_chunk_mb is None
    with pytest.raises(ConfigError, match=r"trainer\.logits_chunk_mb: must be > 0"):
        load_config(SCHEMA, YAML, [*REQUIRED, "trainer.logits_chunk_mb=0"])


def test_vllm_engine_settings_are_checked_by_key():
    cfg = load_config(SCHEMA, YAML, [*REQUIRED, "rollout.engine=vllm", "rollout.vllm.dtype=bfloat16"])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.dtype must be float32, bfloat16 or float16"):
        load_config(SCHEMA, YAML, [*REQUIRED, "rollout.vllm.dtype=int8"])
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.gpu_memory_utilization must lie in \[0, 1\)"):
        load_config(SCHEMA, YAML, [*REQUIRED, "rollout.vllm.gpu_memory_utilization=1.5"])


def test_vllm_engine_without_its_environment_is_refused_in_one_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(64)))
    missing = tmp_path / "no-venv" / "bin" / "python"
    args = [f"data.train_path={prompts}", "actor.tiny=llama", "remote.critic.port=1", "device=cpu"]
    code = main(["train-ppo", str(YAML), *args, "rollout.engine=vllm", f"rollout.vllm.python={missing}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert f"rollout.vllm.python={missing}" in err and "make rollout-setup" in err
    assert len(err.splitlines()) == 1


def test_tis_cap_is_off_by_default_and_refused_where_it_would_do_nothing_or_shrink_updates(capsys):
    assert load_config(SCHEMA, YAML, [*REQUIRED]).trainer.tis_cap == 0
    cfg = load_config(SCHEMA, YAML, [*REQUIRED, "rollout.engine=vllm", "trainer.tis_cap=2"])
    assert cfg.trainer.tis_cap == 2.0
    # below 1 every token's gradient would shrink: refused
    with pytest.raises(ConfigError, match=r"trainer\.tis_cap: must be 0 \(off\) or >= 1"):
        load_config(SCHEMA, YAML, [*REQUIRED, "rollout.engine=vllm", "trainer.tis_cap=0.5"])
    # the hf engine samples with the trainer's own modules: nothing to correct, refused in one line
    assert main(["train-ppo", str(YAML), *REQUIRED, "trainer.tis_cap=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "trainer.tis_cap" in err and "rollout.engine=vllm" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("yaml", [YAML, None], ids=["reference-yaml", "command-line-only"])
def test_an_estimators_own_defaults_apply_with_or_without_the_reference_yaml(yaml):
    """grpo's registration brings n_samples_per_prompt=4, kl_in=loss and its loss aggregation; named
    on the command line alone they must not turn into gae's (1, reward, token_mean)."""
    trainer = load_config(SCHEMA, yaml, [*REQUIRED, "trainer.advantage_estimator=grpo"]).trainer
    assert (trainer.n_samples_per_prompt, trainer.kl_in, trainer.loss_aggregation) == (
        4,
        "loss",
        "seq_mean_token_mean",
    )
    gae = load_config(SCHEMA, yaml, [*REQUIRED]).trainer
    assert (gae.n_samples_per_prompt, gae.kl_in, gae.loss_aggregation) == (1, "reward", "token_mean")
