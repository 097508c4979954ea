"""``openaligner train-rm [CONFIG.yaml] [key=value ...]``: Bradley–Terry reward-model training.

Thin: builds the trainer from the config (see ``configs/train_rm.yaml``), runs it, saves the
resolved config next to the outputs and prints a summary. Under ``torchrun`` every rank runs this
(data parallelism, ``parallel.strategy`` ddp or fsdp); rank 0 writes and prints.

Exit codes: 0 when the run finished; 2 when it was refused at start-up; 130 on SIGINT and 143 on
SIGTERM — during training the step in progress is finished and checkpointed first, and the line
printed names the checkpoint and the command that resumes (:mod:`openaligner.cli.training`).
"""

from __future__ import annotations

from openaligner.cli.training import run_supervised
from openaligner.trainer.rm import RMConfig, build_rm_trainer

SCHEMA = RMConfig
RESUME_KEY = "resume"  # the key that makes the same command continue from the newest checkpoint
_SUMMARY_KEYS = ("train/loss", "train/accuracy", "val/loss", "val/accuracy")


def run(cfg: RMConfig) -> int:
    return run_supervised("train-rm", cfg, build_rm_trainer, _summary)


def _summary(last: dict[str, float]) -> str:
    return ", ".join(f"{k}={last[k]:.4g}" for k in _SUMMARY_KEYS if k in last)
