"""PPO settings on the demo: the same SFT and reward models per seed, one RL stage per setting.

Runs ``openaligner demo seed=S`` (quick or full) once per seed to train the SFT and reward models,
then for each named setting the PPO stage again with the setting's extra ``train-ppo`` (and
``serve-critic``) overrides on top of the demo's own (``reuse_models=true``), and moves each
setting's PPO and critic directories and report aside (``ppo@NAME``, ``critic@NAME``,
``report@NAME.json``) so the next one starts fresh. Prints one line per seed and setting: the
held-out gold score (sampled and greedy) before and after, the KL to the SFT policy, and the
critic's held-out explained variance over the first and last 5 steps, from ``report.json`` and
the run's ``metrics.jsonl``, and what the default ``trainer.critic_stall`` check says of the run
(its metrics replayed through it: ``stall`` with the updates' mean gain on their own rows, or ``ok``).

    python benchmarks/bench_demo_ppo_settings.py --seeds 0 --quick --settings base,decoupled
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

SETTINGS: dict[str, tuple[list[str], list[str]]] = {
    # name: (train-ppo overrides, serve-critic overrides)
    "base": ([], []),
    # the full mode's RL stage before 2026-12-05: 100 steps at the actor's 5e-4
    "steps100+lr5e-4": (["trainer.max_steps=100", "optim.lr=5e-4"], []),
    "decoupled": (["trainer.critic_gae_lambda=1.0"], []),
    "pretrain": (
        ["trainer.value_pretrain.max_steps=10", "trainer.value_pretrain.target_explained_variance=0.5"],
        [],
    ),
    "decoupled+pretrain": (
        [
            "trainer.critic_gae_lambda=1.0",
            "trainer.value_pretrain.max_steps=10",
            "trainer.value_pretrain.target_explained_variance=0.5",
        ],
        [],
    ),
    # other RL stage lengths at the mode's learning rate (the full mode: 300 steps, so steps300 is
    # its own since 2026-12-05, as is actor_lr_2.5e-4+steps300; 100 steps at 5e-4 before)
    "steps200": (["trainer.max_steps=200"], []),
    "steps200+decoupled": (["trainer.max_steps=200", "trainer.critic_gae_lambda=1.0"], []),
    "steps300": (["trainer.max_steps=300"], []),
    # the actor's learning rate twice the earlier default 5e-4, and twice the rollouts per step (128)
    "actor_lr_1e-3": (["optim.lr=1e-3"], []),
    "rollouts128": (["trainer.num_rollout_samples=128"], []),
    # a stronger KL penalty, or half the actor's learning rate, over a longer run
    "kl0.3+steps200": (["trainer.initial_policy_kl_penalty=0.3", "trainer.max_steps=200"], []),
    "actor_lr_2.5e-4+steps200": (["optim.lr=2.5e-4", "trainer.max_steps=200"], []),
    "actor_lr_2.5e-4+steps300": (["optim.lr=2.5e-4", "trainer.max_steps=300"], []),
    "actor_lr_2.5e-4+kl0.3+steps300": (
        ["optim.lr=2.5e-4", "trainer.initial_policy_kl_penalty=0.3", "trainer.max_steps=300"],
        [],
    ),
    # two passes over each rollout; the policy's advantages from Monte-Carlo returns (λ = 1)
    "epochs2": (["trainer.ppo_epochs=2"], []),
    "lambda1": (["trainer.gae_lambda=1.0"], []),
    "critic_lr_1e-6": ([], ["optim.lr=1e-6"]),
    # the critic's learning rate around the demo's 5e-4 (cli/demo/presets.py), 100x smaller to 100x larger
    "critic_lr_5e-6": ([], ["optim.lr=5e-6"]),
    "critic_lr_5e-5": ([], ["optim.lr=5e-5"]),
    "critic_lr_5e-3": ([], ["optim.lr=5e-3"]),
    "critic_lr_5e-2": ([], ["optim.lr=5e-2"]),
}


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def stall_verdict(rows: list[dict[str, float]]) -> str:
    """The default critic-stall check (trainer/critic_stall.py) replayed over a run's step metrics."""
    from openaligner.trainer.critic_stall import CriticStallCheck
    from openaligner.trainer.ppo_config import CriticStallConfig

    d = CriticStallConfig()
    check = CriticStallCheck(d.updates, d.min_rise, d.min_explained_variance, d.min_update_gain)
    for r in rows:
        nan = float("nan")
        stall = check.observe(float(r.get("value/explained_variance_mc", nan)))
        if stall is not None:
            return (
                f"stall (best {stall.best:.2f} from {stall.first:.2f}, update gain {stall.update_gain:+.3f}: "
                f"lr too {'large' if 'too large —' in stall.cause else 'small'})"
            )
        check.update(
            float(r.get("value/train_explained_variance", nan)),
            float(r.get("value/explained_variance_after", nan)),
        )
    return "ok"


def summary(run_dir: Path, name: str) -> str:
    report = json.loads((run_dir / f"report@{name}.json").read_text())
    sft, ppo = report["eval"]["sft"], report["eval"]["ppo"]
    rows = [json.loads(line) for line in (run_dir / f"ppo@{name}" / "logs" / "metrics.jsonl").open()]
    ev = [float(r.get("value/explained_variance_mc", float("nan"))) for r in rows]
    ev_targets = [float(r.get("value/explained_variance", float("nan"))) for r in rows]
    critic_only = sum(int(r.get("value_pretrain/critic_only", 0.0)) for r in rows)
    return (
        f"{run_dir.name} {name}: gold {sft['gold']:.1f} → {ppo['gold']:.1f} "
        f"(greedy {sft['gold_greedy']:.1f} → {ppo['gold_greedy']:.1f}), KL {ppo['kl_to_sft']:.2f}, "
        f"held-out EV first 5 {_mean(ev[:5]):.3f} "
        f"last 5 {_mean(ev[-5:]):.3f} (against the critic's targets: {_mean(ev_targets[:5]):.3f}, "
        f"{_mean(ev_targets[-5:]):.3f}), critic-only steps {critic_only}, critic_stall: {stall_verdict(rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--settings", default="base,decoupled")
    parser.add_argument("--out", default="runs", help="run directories go here: q-s<seed> (quick), s<seed>")
    args = parser.parse_args()

    import openaligner.cli.demo as demo

    own_ppo, own_critic = demo.ppo_overrides, demo.serve_critic_overrides
    for seed in (int(s) for s in args.seeds.split(",")):
        run_dir = Path(args.out) / f"{'q-' if args.quick else ''}s{seed}"
        for name in args.settings.split(","):
            if (run_dir / f"report@{name}.json").is_file():
                print(summary(run_dir, name), flush=True)
                continue
            ppo_extra, critic_extra = SETTINGS[name]
            demo.ppo_overrides = lambda *a, _e=ppo_extra, **k: own_ppo(*a, **k) + _e
            demo.serve_critic_overrides = lambda *a, _e=critic_extra, **k: own_critic(*a, **k) + _e
            reuse = (run_dir / "sft" / "config.json").is_file()
            cfg = demo.DemoConfig(seed=seed, quick=args.quick, output_dir=str(run_dir), reuse_models=reuse)
            rc = demo.run(cfg)
            if rc not in (0, 1):
                raise SystemExit(f"demo seed={seed} setting {name} exited {rc}")
            for d in ("ppo", "critic"):
                shutil.move(run_dir / d, run_dir / f"{d}@{name}")
            shutil.move(run_dir / "report.json", run_dir / f"report@{name}.json")
            print(summary(run_dir, name), flush=True)


if __name__ == "__main__":
    main()
