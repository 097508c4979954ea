"""Training checkpoint files: what is written is what is read back, in place."""

import random

import torch

from openaligner.io.checkpoint import rng_state
from openaligner.trainer.checkpoint_files import OPTIMIZER_FILE, RNG_FILE, SCHEDULER_FILE, TrainingFiles

FILES = TrainingFiles(model_dir="model", state_file="state.json")


def parts(tiny):
    critic = tiny.critic()
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return critic, optimizer, scheduler


def test_round_trip(tiny, tmp_path):
    critic, optimizer, scheduler = parts(tiny)
    critic(torch.randint(3, 90, (2, 5))).sum().backward()
    optimizer.step()
    scheduler.step()
    random.seed(7)
    FILES.write(tmp_path, critic, optimizer, scheduler, [rng_state()])
    FILES.write_state(tmp_path, {"step": 3})
    assert {p.name for p in tmp_path.iterdir()} == {
        "model",
        OPTIMIZER_FILE,
        SCHEDULER_FILE,
        RNG_FILE,
        "state.json",
    }
    drawn = random.random()
    other, other_opt, other_sched = parts(tiny)
    params = list(other.parameters())
    assert FILES.read(tmp_path, other, other_opt, other_sched, torch.device("cpu")) == {"step": 3}
    assert all(a is b for a, b in zip(params, other.parameters(), strict=True))  # loaded in place
    assert all(torch.equal(a, b) for a, b in zip(critic.parameters(), other.parameters(), strict=True))
    assert other_sched.state_dict()["last_epoch"] == 1 and other_opt.state_dict()["state"][0]["step"] == 1
    FILES.restore_rng(tmp_path, rank=0)
    assert random.random() == drawn
    FILES.restore_rng(tmp_path, rank=1)  # a rank the run did not have keeps its own RNGs
