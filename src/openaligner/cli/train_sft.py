"""``openaligner train-sft [CONFIG.yaml] [key=value ...]``: supervised fine-tuning of a causal LM.

Thin: builds the trainer from the config (see ``configs/train_sft.yaml``), runs it, saves the
resolved config next to the outputs and prints a summary.
"""

from __future__ import annotations

from pathlib import Path

from openaligner.config import save_config
from openaligner.trainer.sft import SFTConfig, build_sft_trainer

SCHEMA = SFTConfig


def run(cfg: SFTConfig) -> int:
    trainer = build_sft_trainer(cfg)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    save_config(cfg, Path(cfg.output_dir) / "config.yaml")
    history = trainer.fit()
    last = history[-1] if history else {}
    summary = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if k.endswith("loss"))
    steps = f"steps {trainer.start_step} → {trainer.state.step}"
    print(f"train-sft: {steps}; {summary}; model saved to {cfg.output_dir}")
    return 0
