"""The demo's in-process stages: the task data, each command's full YAML, and running a command.

Owns what a stage leaves in the run directory (data, tokenizer, ``configs/*.yaml``), whether a
trained model there can stand in for a stage, and how a command runs in this process (as the
command line would). Knows nothing of servers or reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from openaligner.cli.demo.presets import Preset


def make_data(run_dir: Path, seed: int, preset: Preset) -> tuple[str, str]:
    """Write the four data sets and the tokenizer; an example PPO prompt and its gold answer."""
    from openaligner.models.tokenizers import build_word_tokenizer
    from openaligner.tasks.sorting import VOCABULARY, answer, generate_task_data, write_jsonl

    data = generate_task_data(seed, preset.n_sft, preset.n_pref, preset.n_ppo, n_val=256)
    d = run_dir / "data"
    write_jsonl(data.sft, d / "sft.jsonl")
    write_jsonl(data.preferences, d / "preferences.jsonl")
    write_jsonl(data.ppo_prompts, d / "ppo_prompts.jsonl")
    write_jsonl(data.val_prompts, d / "val_prompts.jsonl")
    build_word_tokenizer(VOCABULARY).save_pretrained(str(run_dir / "tokenizer"))
    example = data.ppo_prompts[0]["prompt"]
    return example, answer(example)


def config_yaml(command: str, overrides: Sequence[str]) -> str:
    """The full YAML of ``overrides`` resolved against the command's schema."""
    from openaligner.cli.main import command as command_of
    from openaligner.config import config_to_yaml, load_config

    return config_to_yaml(load_config(command_of(command).SCHEMA, None, list(overrides)))


def write_config(path: Path, command: str, overrides: Sequence[str]) -> Path:
    """Resolve ``overrides`` against the command's schema and write the full YAML."""
    path.write_text(config_yaml(command, overrides))
    return path


def reuse_problem(model_dir: Path, yaml_path: Path, command: str, overrides: Sequence[str]) -> str | None:
    """Why the model in ``model_dir`` cannot stand in for running ``command`` with ``overrides``;
    None when it can: the training finished (the final model is there) and the YAML it was trained
    from, ``yaml_path``, is the one these overrides give (same seed, mode, steps and paths: a moved
    run directory is trained again)."""
    if not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        return f"{model_dir} holds no trained model"
    if not yaml_path.is_file():
        return f"{yaml_path} is missing, so what {model_dir} was trained with is unknown"
    from openaligner.config import ConfigError

    try:
        asked = config_yaml(command, overrides)
    except ConfigError as e:  # e.g. the run directory's tokenizer or data are gone
        return f"the configuration {model_dir} was trained with cannot be checked: {e}"
    if yaml_path.read_text() != asked:
        return (
            f"{model_dir} was trained with another configuration than asked (seed, mode, step counts or "
            f"run directory; see {yaml_path})"
        )
    return None


def run_command(command: str, yaml_path: Path) -> None:
    """Run ``openaligner <command> <yaml>`` in this process, as the command line does.

    Raises:
        KeyboardInterrupt: the command was stopped by SIGINT or SIGTERM (exit code 130 or 143).
        RuntimeError: it failed with any other non-zero exit code.
    """
    from openaligner.cli.main import main

    rc = main([command, str(yaml_path)])
    if rc in (130, 143):  # the command was stopped by SIGINT or SIGTERM (train-ppo says so itself)
        raise KeyboardInterrupt
    if rc != 0:
        raise RuntimeError(f"`openaligner {command} {yaml_path}` failed with exit code {rc}")
