"""``openaligner train-sft [CONFIG.yaml] [key=value ...]``: supervised fine-tuning of a causal LM.

Thin: builds the trainer from the config (see ``configs/train_sft.yaml``), runs it, saves the
resolved config next to the outputs and prints a summary. Under ``torchrun`` every rank runs this
(data parallelism, ``parallel.strategy`` ddp or fsdp); rank 0 writes and prints.
"""

from __future__ import annotations

from pathlib import Path

from openaligner import distributed as dp
from openaligner.config import save_config
from openaligner.trainer.sft import SFTConfig, build_sft_trainer

SCHEMA = SFTConfig


def run(cfg: SFTConfig) -> int:
    dp.init_from_env()
    leader = dp.is_leader()
    trainer = build_sft_trainer(cfg)
    if leader:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "config.yaml")
    history = trainer.fit()
    dp.shutdown()
    if not leader:
        return 0
    last = history[-1] if history else {}
    summary = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if k.endswith("loss"))
    steps = f"steps {trainer.start_step} → {trainer.state.step}"
    print(f"train-sft: {steps}; {summary}; model saved to {cfg.output_dir}")
    return 0
