"""``openaligner train-rm [CONFIG.yaml] [key=value ...]``: Bradley–Terry reward-model training.

Thin: builds the trainer from the config (see ``configs/train_rm.yaml``), runs it, saves the
resolved config next to the outputs and prints a summary. Under ``torchrun`` every rank runs this
(data parallelism, ``parallel.strategy`` ddp or fsdp); rank 0 writes and prints.
"""

from __future__ import annotations

from pathlib import Path

from openaligner import distributed as dp
from openaligner.config import save_config
from openaligner.trainer.rm import RMConfig, build_rm_trainer

SCHEMA = RMConfig


def run(cfg: RMConfig) -> int:
    dp.init_from_env()
    leader = dp.is_leader()
    trainer = build_rm_trainer(cfg)
    if leader:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "config.yaml")
    history = trainer.fit()
    dp.shutdown()
    if not leader:
        return 0
    last = history[-1] if history else {}
    keys = ("train/loss", "train/accuracy", "val/loss", "val/accuracy")
    summary = ", ".join(f"{k}={last[k]:.4g}" for k in keys if k in last)
    steps = f"steps {trainer.start_step} → {trainer.state.step}"
    print(f"train-rm: {steps}; {summary}; model saved to {cfg.output_dir}")
    return 0
