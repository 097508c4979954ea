"""``openaligner train-sft|train-rm [CONFIG.yaml] [key=value ...]``: the two supervised trainers.

train-sft fine-tunes a causal LM (``configs/train_sft.yaml``); train-rm trains a Bradley–Terry
reward model (``configs/train_rm.yaml``). Thin: each builds its trainer from the config, runs it,
saves the resolved config next to the outputs and prints a summary. Under ``torchrun`` every rank
runs it (data parallelism, ``parallel.strategy`` ddp or fsdp); rank 0 writes and prints.

Exit codes: 0 when the run finished; 2 when it was refused at start-up; 130 on SIGINT and 143 on
SIGTERM — during training the step in progress is finished and checkpointed first, and the line
printed names the checkpoint and the command that resumes (:mod:`openaligner.cli.training`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openaligner.cli.training import run_supervised
from openaligner.trainer.rm import RMConfig, build_rm_trainer
from openaligner.trainer.sft import SFTConfig, build_sft_trainer
from openaligner.trainer.supervised import SupervisedRunConfig, SupervisedTrainer


@dataclass
class SupervisedCommand:
    """One supervised command as :mod:`openaligner.cli.main` runs a command: ``SCHEMA``,
    ``run(cfg)`` and ``RESUME_KEY``."""

    name: str  # the command, in its messages (train-sft)
    SCHEMA: type[SupervisedRunConfig]  # its config dataclass
    build: Callable[[Any], SupervisedTrainer[Any]]  # config → trainer, nothing trained yet
    summary: Callable[[dict[str, float]], str]  # the last metrics → the end line's summary
    RESUME_KEY: str = "resume"  # the key that makes the same command continue from the newest checkpoint

    def run(self, cfg: SupervisedRunConfig) -> int:
        return run_supervised(self.name, cfg, self.build, self.summary)


def _sft_summary(last: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in last.items() if k.endswith("loss"))


_RM_SUMMARY_KEYS = ("train/loss", "train/accuracy", "val/loss", "val/accuracy")


def _rm_summary(last: dict[str, float]) -> str:
    return ", ".join(f"{k}={last[k]:.4g}" for k in _RM_SUMMARY_KEYS if k in last)


TRAIN_SFT = SupervisedCommand("train-sft", SFTConfig, build_sft_trainer, _sft_summary)
TRAIN_RM = SupervisedCommand("train-rm", RMConfig, build_rm_trainer, _rm_summary)
