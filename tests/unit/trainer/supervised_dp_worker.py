"""Runs ``openaligner train-sft`` or ``train-rm`` on a tiny model, on 1 process or under torchrun.

Used by test_supervised_distributed.py: ``python supervised_dp_worker.py OUT DATA [key=value ...]``
or ``torchrun --nproc_per_node 2 supervised_dp_worker.py OUT DATA [key=value ...]``, with
``OBJECTIVE`` (sft or rm) in the environment; the overrides follow the worker's own (e.g.
``parallel.strategy=fsdp``, ``model.tiny=llama``). The run goes through the command itself (its
process group, rank-0 writes, shutdown) with ``OUT/run`` as output_dir. Every rank writes
``OUT/rank<r>.json``: the command's exit code and how many forwards this rank ran in training and
in validation.
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

from openaligner.cli.main import main
from openaligner.trainer.rm import RMObjective
from openaligner.trainer.sft import SFTObjective

COMMON = (
    "model.tiny_hidden_size=32",
    "model.tiny_num_layers=2",
    "model.tiny_num_heads=2",
    "model.tiny_max_positions=64",
    "trainer.max_steps=3",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",  # 2 micro-batches per rank with 2 ranks, 4 with one process
    "trainer.val_check_interval=0",  # validation once, after the last step
    "trainer.val_micro_batch_size=2",  # 5 records → 3 micro-batches: rank 1 repeats one
    "trainer.save_interval=0",
    "optim.lr=3e-3",
    "progress=false",
    "device=cpu",
    "resume=false",
)


def run(out: Path, data: Path, overrides: list[str]) -> int:
    torch.set_num_threads(1)
    objective = os.environ["OBJECTIVE"]
    cls = SFTObjective if objective == "sft" else RMObjective
    forwards: Counter[str] = Counter()
    loss = cls.loss

    def counted_loss(self, batch):
        forwards["train" if self.module.training else "val"] += 1
        return loss(self, batch)

    cls.loss = counted_loss
    args = [
        f"data.train_path={data / f'{objective}.jsonl'}",
        f"data.val_path={data / f'{objective}_val.jsonl'}",
        f"output_dir={out / 'run'}",
        *COMMON,
        *overrides,
    ]
    code = main([f"train-{objective}", *args])
    rank = os.environ.get("RANK", "0")
    (out / f"rank{rank}.json").write_text(json.dumps({"code": code, "forwards": forwards}))
    return code


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]))
