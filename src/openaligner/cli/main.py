"""``openaligner <command> [CONFIG.yaml] [key=value ...]``: dispatch to the module of each command.

Owns the command and tool tables (each command exposes ``SCHEMA``, ``run(cfg) -> int`` and
``RESUME_KEY``; a tool, ``main(argv) -> int``), lazy imports, and the one place a run is refused
(``ConfigError`` / ``StartupError`` → one line, exit 2) or reported stopped by a signal (exit 130
or 143). Must not know what any command does.
Design notes: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from openaligner import __version__
from openaligner.cli.plugins import declared_plugins, import_plugins
from openaligner.config import ConfigError, describe_config, load_config
from openaligner.trainer.stopping import TrainingStopped

# name -> (module or module:attribute, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("openaligner.cli.demo", "run the built-in end-to-end example and report what it shows"),
    "serve-reward": ("openaligner.cli.serve_reward", "serve a frozen reward model over HTTP (Triton)"),
    "serve-critic": ("openaligner.cli.serve_critic", "serve a trainable critic and the reward model (HTTP)"),
    "serve-rollout": (
        "openaligner.cli.serve_rollout",
        "serve a vLLM rollout engine that train-ppo runs attach to (rollout.vllm.url)",
    ),
    "serve-tinker": (
        "openaligner.cli.serve_tinker",
        "serve the Tinker training API (tinker SDK, tinker-cookbook recipes) on local models",
    ),
    "train-sft": (
        "openaligner.cli.train_supervised:TRAIN_SFT",
        "supervised fine-tuning on prompt/response JSONL",
    ),
    "train-ppo": ("openaligner.cli.train_ppo", "PPO actor training against the served critic and RM"),
    "train-rm": (
        "openaligner.cli.train_supervised:TRAIN_RM",
        "Bradley-Terry reward-model training on preference JSONL",
    ),
}
# name -> (module, one-line help): commands with their own arguments (no config file)
TOOLS: dict[str, tuple[str, str]] = {
    "export-critic": (
        "openaligner.cli.export_critic",
        "write a critic checkpoint (either layout) as a Hugging Face directory",
    ),
    "convert-gguf": (
        "openaligner.cli.convert_gguf",
        "convert a GGUF model (a .gguf file or a package shipping one) into a Hugging Face directory",
    ),
    "evaluate-task": (
        "openaligner.cli.evaluate_task",
        "a model's gold score on a built-in task's prompts (sampled, greedy) and its KL to a reference",
    ),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openaligner",
        description="RLHF with PPO on Hugging Face models; reward model and critic served over HTTP.",
    )
    p.add_argument("--version", action="version", version=f"openaligner {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.add_argument(
            "args",
            nargs="*",
            metavar="[CONFIG.yaml] [key=value ...]",
            help="optional YAML config file, then dotted overrides",
        )
        sp.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    for name, (_, help_text) in TOOLS.items():  # listed here; main() hands them their arguments
        sub.add_parser(name, help=help_text, description=help_text)
    return p


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """Split ``[CONFIG.yaml] [key=value ...]`` into the config path and the overrides."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


_FLAGS = ("--print-config", "--help", "-h")
"""A command's own flags; every other argument is a config file or a ``key=value`` override."""


def dashed_overrides(command: str, args: Sequence[str]) -> list[str]:
    """A command's arguments with ``--key=value`` (the TRL / OpenRLHF habit) read as ``key=value``.

    Raises:
        ConfigError: an argument ``--key`` without ``=value`` (other than :data:`_FLAGS`), saying
            how overrides are written.
    """
    out = []
    for a in args:
        if not a.startswith("-") or a in _FLAGS:
            out.append(a)
        elif "=" in a:
            out.append(a.lstrip("-"))
        else:
            key = a.lstrip("-")
            raise ConfigError(
                f"{a} is not an option of openaligner {command}: settings are written key=value, e.g. "
                f"{key}=VALUE (--{key}=VALUE works too); openaligner {command} --print-config lists the keys"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in TOOLS:
        return _run_tool(args[0], args[1:])
    if args and args[0] in COMMANDS:
        try:
            args = [args[0], *dashed_overrides(args[0], args[1:])]
        except ConfigError as e:
            print(f"openaligner {args[0]}: {e}", file=sys.stderr)
            return 2
    parser = _parser()
    ns = parser.parse_args(args)
    if ns.command is None:
        parser.print_help()
        return 2
    _quiet_libraries()
    module = command(ns.command)
    path, overrides = split_config_args(ns.args)
    try:
        # before the config: what the plugins register (an estimator) must be a name it takes
        import_plugins(declared_plugins(module.SCHEMA, path, overrides))
        if ns.print_config:
            return _print_config(ns.command, module.SCHEMA, path, overrides)
        cfg = load_config(module.SCHEMA, path, overrides)
        return int(module.run(cfg) or 0)
    except ConfigError as e:  # StartupError included
        print(f"openaligner {ns.command}: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        from openaligner import distributed as dp
        from openaligner.cli.training import EXIT_CODES, stopped_line

        key = module.RESUME_KEY
        line = stopped_line(ns.command, e, [ns.command, *ns.args], key, bool(_dotted(cfg, key)))
        if dp.is_leader():
            print(line, file=sys.stderr, flush=True)
        return EXIT_CODES.get(e.reason, 130)


def command(name: str) -> Any:
    """What runs command ``name`` (a key of :data:`COMMANDS`): its module, or the object its
    ``module:attribute`` names; either exposes ``SCHEMA``, ``run(cfg)`` and ``RESUME_KEY``."""
    target, _, attribute = COMMANDS[name][0].partition(":")
    module = importlib.import_module(target)
    return getattr(module, attribute) if attribute else module


def _dotted(cfg: object, key: str) -> object:
    """The value of dotted ``key`` in the config dataclass ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _run_tool(name: str, args: Sequence[str]) -> int:
    """Run tool ``name`` on its own arguments; a refusal is one line and exit code 2."""
    _quiet_libraries()
    try:
        return int(importlib.import_module(TOOLS[name][0]).main(args))
    except ConfigError as e:  # StartupError included
        print(f"openaligner {name}: {e}", file=sys.stderr)
        return 2


def _print_config(command: str, schema: type, path: str | None, overrides: Sequence[str]) -> int:
    """Print the resolved config; mandatory values still missing show as ``???`` and are named."""
    text, missing = describe_config(schema, path, overrides)
    print(text, end="")
    if missing:
        print(f"openaligner {command}: still to set before a run: {', '.join(missing)}", file=sys.stderr)
    return 0


def _quiet_libraries() -> None:
    """Silence per-file progress bars of transformers (weights loading/writing) in command output."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    # Load reports (e.g. "score.weight newly initialized" when a reward model starts from an SFT
    # model) are expected here; real problems still raise.
    hf_logging.set_verbosity_error()


def entry() -> int:
    """The ``openaligner`` console command: :func:`main`, then the process ends as
    :func:`openaligner.distributed.finish` says (a torchrun rank skips interpreter teardown)."""
    from openaligner import distributed as dp

    return dp.finish(main())


if __name__ == "__main__":
    raise SystemExit(entry())
