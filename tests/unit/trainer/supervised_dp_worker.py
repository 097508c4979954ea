"""Runs ``openaligner train-sft`` or ``train-rm`` on a tiny model, on 1 process or under torchrun.

Used by test_supervised_distributed.py: ``python supervised_dp_worker.py OUT DATA [key=value ...]``
or ``torchrun --nproc_per_node 2 supervised_dp_worker.py OUT DATA [key=value ...]``, with
``OBJECTIVE`` (sft or rm) in the environment; the overrides follow the worker's own (e.g.
``parallel.strategy=fsdp``, ``model.tiny=llama``). The run goes through the command itself (its
process group, rank-0 writes, shutdown) with ``OUT/run`` as output_dir. Every rank writes
``OUT/rank<r>.json``: the command's exit code and how many forwards this rank ran in training and
in validation.

``OPTIMIZER=sgd`` in the environment swaps AdamW for plain SGD (no momentum, constant rate): an
update then is ``lr × gradient``, linear in the gradient, so weights of two runs differ by the
learning rate times their gradients' rounding differences and nothing amplifies them (AdamW's
``g / (√v + ε)`` turns rounding noise on near-zero gradients into updates of up to ``lr``).
``DEFECT=summed`` (for the test that shows the comparison catches defects) doubles every rank's
gradients before the optimizer step: two ranks summing their gradients instead of averaging.
``SIGINT_AT=<rank>:<n>`` sends SIGINT to that rank alone at its ``n``-th training forward (a stop
asked on one rank).
"""

import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import torch

from openaligner import distributed as dp
from openaligner.cli.main import main
from openaligner.trainer import supervised
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


def sgd(params, cfg, run_steps):
    """Plain SGD at ``cfg.lr`` with a constant schedule, in place of AdamW."""
    optimizer = torch.optim.SGD([p for p in params if p.requires_grad], lr=cfg.lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def double_gradients_before_step(optimizer) -> None:
    """A defect on purpose: this rank's gradients doubled before every optimizer step."""

    def pre_step(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(2)

    optimizer.register_step_pre_hook(pre_step)


def run(out: Path, data: Path, overrides: list[str]) -> int:
    torch.set_num_threads(1)
    if os.environ.get("OPTIMIZER") == "sgd":
        supervised.build_optimizer = sgd
    if os.environ.get("DEFECT") == "summed":
        build = supervised.build_optimizer

        def defective(params, cfg, run_steps):
            optimizer, scheduler = build(params, cfg, run_steps)
            double_gradients_before_step(optimizer)
            return optimizer, scheduler

        supervised.build_optimizer = defective
    objective = os.environ["OBJECTIVE"]
    cls = SFTObjective if objective == "sft" else RMObjective
    forwards: Counter[str] = Counter()
    loss = cls.loss

    stop_rank, _, stop_at = os.environ.get("SIGINT_AT", "-1:0").partition(":")

    def counted_loss(self, batch):
        forwards["train" if self.module.training else "val"] += 1
        if self.module.training and dp.rank() == int(stop_rank) and forwards["train"] == int(stop_at):
            os.kill(os.getpid(), signal.SIGINT)
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
    # a rank skips interpreter teardown (distributed.finish says why)
    sys.exit(dp.finish(run(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])))
