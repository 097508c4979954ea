"""``openaligner export-critic CHECKPOINT OUT [--dtype D] [--config-dir MODEL_DIR]``: a critic
checkpoint (``step_<N>`` under the critic server's ``checkpoint.dir``, either layout: one
process's Hugging Face directory or every rank's shards) as a Hugging Face
``*ForSequenceClassification`` directory that ``AutoModelForSequenceClassification`` loads.

Thin: parses the arguments and calls :func:`openaligner.trainer.critic.export_checkpoint`. One
process, on the CPU, whatever the number of ranks that wrote the checkpoint. A checkpoint that
cannot be exported is refused in one line (exit code 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from openaligner.config import StartupError

DTYPES = ("auto", "fp32", "bf16", "fp16")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openaligner export-critic",
        description="write a critic checkpoint as a Hugging Face directory "
        "(AutoModelForSequenceClassification)",
    )
    p.add_argument("checkpoint", type=Path, help="a step_<N> directory of the critic server's checkpoint.dir")
    p.add_argument("out", type=Path, help="the Hugging Face directory to write")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="the weights' dtype on disk (auto: as stored, the float32 masters)",
    )
    p.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="the model directory the critic server started from (model.path); needed only for "
        "sharded checkpoints written before they carried their config.json",
    )
    return p


def main(argv: Sequence[str]) -> int:
    """Export; raises :class:`~openaligner.config.StartupError` (exit 2) naming what is wrong."""
    import torch

    from openaligner.trainer.critic import export_checkpoint

    args = _parser().parse_args(list(argv))
    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        export_checkpoint(args.checkpoint, args.out, dtype, args.config_dir)
    except (ValueError, OSError) as e:
        raise StartupError(str(e)) from None
    print(f"export-critic: {args.checkpoint} written to {args.out} as a Hugging Face directory")
    return 0
