"""``openaligner demo``: the whole RLHF pipeline on the built-in sorting task, end to end.

Stages: (1) data and tokenizer → (2) SFT → (3) reward model on gold-labelled noisy preferences
→ (4) reward model and critic served by separate processes on free loopback ports → (5) PPO
against the *learned* reward model → (6) evaluation against the gold scorer and a report with
plots. Every stage runs the same command a user would (``train-sft``, ``train-rm``,
``serve-reward``, ``serve-critic``, ``train-ppo``) from a YAML file written into the run
directory, so each can be re-run on its own. Servers are stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class DemoConfig:
    seed: int = 0  # seeds data, models, sampling and training
    quick: bool = False  # the CI-sized run (about 2 minutes); else the full run (under 10 minutes)
    output_dir: str = "runs/demo"  # run directory: data, configs, models, logs, plots, report.md
    host: str = "127.0.0.1"  # where the servers listen (loopback)
    sft_steps: int = 0  # SFT optimizer steps; 0 = the preset of the mode
    rm_steps: int = 0  # reward-model optimizer steps; 0 = the preset of the mode
    ppo_steps: int = 0  # PPO steps; 0 = the preset of the mode
    eval_samples: int = 256  # held-out prompts scored by the gold scorer before and after PPO
    server_start_timeout_s: float = 180.0  # how long to wait for each server to become ready

    def __post_init__(self) -> None:
        if min(self.sft_steps, self.rm_steps, self.ppo_steps) < 0 or self.eval_samples < 8:
            raise ValueError("step counts must be >= 0 (0 = preset) and eval_samples >= 8")


SCHEMA = DemoConfig


@dataclass(frozen=True)
class Preset:
    n_sft: int
    n_pref: int
    n_ppo: int
    sft_steps: int
    rm_steps: int
    ppo_steps: int


PRESETS = {
    "full": Preset(n_sft=4000, n_pref=3000, n_ppo=2048, sft_steps=800, rm_steps=400, ppo_steps=100),
    "quick": Preset(n_sft=3000, n_pref=2000, n_ppo=1024, sft_steps=400, rm_steps=200, ppo_steps=30),
}
ROLLOUTS_PER_STEP = 64
MAX_NEW_TOKENS = 8


@dataclass
class StageTimes:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - t0


def run(cfg: DemoConfig) -> int:
    console = Console()
    preset = PRESETS["quick" if cfg.quick else "full"]
    sft_steps = cfg.sft_steps or preset.sft_steps
    rm_steps = cfg.rm_steps or preset.rm_steps
    ppo_steps = cfg.ppo_steps or preset.ppo_steps
    run_dir = Path(cfg.output_dir).resolve()
    configs, logs = run_dir / "configs", run_dir / "logs"
    for d in (configs, logs):
        d.mkdir(parents=True, exist_ok=True)
    times = StageTimes()
    t_start = time.perf_counter()
    servers: list[subprocess.Popen[bytes]] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _banner(console, 1, "data: the sorting task, its tokenizer and four data sets")
        with times("data"):
            paths = _make_data(run_dir, cfg.seed, preset)
        console.print(f"  prompts like [bold]{paths['example']}[/] → gold answer [bold]{paths['answer']}[/]")

        _banner(console, 2, f"SFT: a tiny GPT-2 imitates mixed demonstrations ({sft_steps} steps)")
        sft_yaml = _write_config(
            configs / "sft.yaml", "train-sft", _sft_overrides(run_dir, cfg.seed, sft_steps)
        )
        with times("sft"):
            _run_command("train-sft", sft_yaml)

        _banner(
            console,
            3,
            f"reward model: Bradley–Terry on gold-labelled pairs with 10% label noise ({rm_steps} steps)",
        )
        rm_yaml = _write_config(configs / "rm.yaml", "train-rm", _rm_overrides(run_dir, cfg.seed, rm_steps))
        with times("reward_model"):
            _run_command("train-rm", rm_yaml)
        rm_metrics = _last_metrics(run_dir / "rm" / "metrics.jsonl", "val/")

        _banner(console, 4, "serving: reward model and critic in their own processes")
        rm_port, critic_port = _free_port(cfg.host), _free_port(cfg.host)
        reward_yaml = _write_config(
            configs / "serve_reward.yaml", "serve-reward", _serve_reward_overrides(run_dir, cfg, rm_port)
        )
        critic_yaml = _write_config(
            configs / "serve_critic.yaml",
            "serve-critic",
            _serve_critic_overrides(run_dir, cfg, critic_port, rm_port),
        )
        with times("server_start"):
            servers.append(_start_server("serve-reward", reward_yaml, logs / "serve_reward.log"))
            servers.append(_start_server("serve-critic", critic_yaml, logs / "serve_critic.log"))
            _wait_ready(
                cfg.host,
                rm_port,
                "reward_model",
                servers[0],
                logs / "serve_reward.log",
                cfg.server_start_timeout_s,
            )
            _wait_ready(
                cfg.host,
                critic_port,
                "critic_infer",
                servers[1],
                logs / "serve_critic.log",
                cfg.server_start_timeout_s,
            )
        console.print(
            f"  reward model  http://{cfg.host}:{rm_port}   critic  http://{cfg.host}:{critic_port}"
        )

        _banner(
            console,
            5,
            f"PPO against the learned reward model ({ppo_steps} steps × {ROLLOUTS_PER_STEP} rollouts)",
        )
        ppo_yaml = _write_config(
            configs / "ppo.yaml", "train-ppo", _ppo_overrides(run_dir, cfg, ppo_steps, critic_port, rm_port)
        )
        with times("ppo"):
            _run_command("train-ppo", ppo_yaml)

        _banner(console, 6, "evaluation against the gold scorer")
        with times("evaluation"):
            report = _evaluate(run_dir, cfg, rm_port)
        times.seconds["total"] = time.perf_counter() - t_start
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]: stopping the servers")
        return 130
    finally:
        _stop_servers(servers)
        signal.signal(signal.SIGTERM, previous)

    ppo_metrics = _read_jsonl(run_dir / "ppo" / "logs" / "metrics.jsonl")
    plot = _plot(ppo_metrics, run_dir / "ppo_curves.png")
    _write_report(run_dir, report, rm_metrics, times.seconds, plot, cfg)
    _print_summary(console, report, rm_metrics, times.seconds, run_dir)
    gain = report["ppo"]["gold"] - report["sft"]["gold"]
    return 0 if gain > 0 else 1


# ---------------------------------------------------------------------- stages
def _make_data(run_dir: Path, seed: int, preset: Preset) -> dict[str, str]:
    from openaligner.models.tokenizers import build_word_tokenizer
    from openaligner.tasks.sorting import VOCABULARY, answer, generate_task_data, write_jsonl

    data = generate_task_data(seed, preset.n_sft, preset.n_pref, preset.n_ppo, n_val=256)
    d = run_dir / "data"
    write_jsonl(data.sft, d / "sft.jsonl")
    write_jsonl(data.preferences, d / "preferences.jsonl")
    write_jsonl(data.ppo_prompts, d / "ppo_prompts.jsonl")
    write_jsonl(data.val_prompts, d / "val_prompts.jsonl")
    build_word_tokenizer(VOCABULARY).save_pretrained(str(run_dir / "tokenizer"))
    example = data.ppo_prompts[0]["prompt"]
    return {"example": example, "answer": answer(example)}


def _tiny_model(seed: int) -> list[str]:
    return [
        "model.tiny=gpt2",
        "model.tiny_hidden_size=64",
        "model.tiny_num_layers=2",
        "model.tiny_num_heads=4",
        "model.tiny_max_positions=64",
        f"model.tiny_seed={seed}",
    ]


def _sft_overrides(run_dir: Path, seed: int, steps: int) -> list[str]:
    return [
        *_tiny_model(seed),
        f"tokenizer.path={run_dir / 'tokenizer'}",
        f"data.train_path={run_dir / 'data' / 'sft.jsonl'}",
        "data.val_fraction=0.05",
        "optim.lr=3e-3",
        "optim.scheduler=cosine",
        "optim.min_lr=3e-4",
        "optim.warmup_steps=20",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=64",
        f"trainer.val_check_interval={steps}",
        f"trainer.save_interval={steps}",
        "trainer.keep_last=1",
        f"trainer.seed={seed}",
        f"output_dir={run_dir / 'sft'}",
        "device=cpu",
    ]


def _rm_overrides(run_dir: Path, seed: int, steps: int) -> list[str]:
    return [
        f"model.path={run_dir / 'sft'}",  # the reward model starts from the SFT backbone
        f"tokenizer.path={run_dir / 'tokenizer'}",
        f"data.train_path={run_dir / 'data' / 'preferences.jsonl'}",
        "data.val_fraction=0.1",
        "optim.lr=1e-3",
        "optim.scheduler=cosine",
        "optim.min_lr=1e-4",
        "optim.warmup_steps=10",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=64",
        f"trainer.val_check_interval={steps}",
        f"trainer.save_interval={steps}",
        "trainer.keep_last=1",
        f"trainer.seed={seed}",
        f"output_dir={run_dir / 'rm'}",
        "device=cpu",
    ]


def _serve_reward_overrides(run_dir: Path, cfg: DemoConfig, port: int) -> list[str]:
    return [
        f"model.path={run_dir / 'rm'}",
        f"server.host={cfg.host}",
        f"server.port={port}",
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        "threads=1",  # the actor trainer needs the cores most
    ]


def _serve_critic_overrides(run_dir: Path, cfg: DemoConfig, port: int, rm_port: int) -> list[str]:
    return [
        f"model.path={run_dir / 'rm'}",  # the critic starts from the reward model
        f"server.host={cfg.host}",
        f"server.port={port}",
        "server.combine_rm_and_critic_server=false",  # rewards come from the reward server
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        "train.global_batch_size=64",
        "train.micro_batch_size=64",
        "optim.lr=5e-4",
        "optim.scheduler=constant",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        f"checkpoint.dir={run_dir / 'critic'}",
        "threads=1",  # the actor trainer needs the cores most
    ]


def _ppo_overrides(run_dir: Path, cfg: DemoConfig, steps: int, critic_port: int, rm_port: int) -> list[str]:
    return [
        f"actor.path={run_dir / 'sft'}",
        f"tokenizer.path={run_dir / 'tokenizer'}",
        "device=cpu",
        f"data.train_path={run_dir / 'data' / 'ppo_prompts.jsonl'}",
        f"data.val_path={run_dir / 'data' / 'val_prompts.jsonl'}",
        "data.seq_length=64",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=100",
        f"trainer.num_rollout_samples={ROLLOUTS_PER_STEP}",
        "trainer.rollout_micro_batch_size=16",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16",
        "trainer.num_val_samples=64",
        "trainer.val_rollout_micro_batch_size=32",
        f"trainer.val_check_interval={max(steps // 5, 1)}",
        f"trainer.save_interval={max(steps // 5, 1)}",
        "trainer.initial_policy_kl_penalty=0.2",  # strong enough that PPO does not exploit the RM
        f"trainer.length.max_length={MAX_NEW_TOKENS}",
        f"trainer.seed={cfg.seed}",
        "trainer.sample_table_interval=10",
        "optim.lr=5e-4",
        "remote.combine_rm_and_critic_server=false",
        f"remote.critic.ip={cfg.host}",
        f"remote.critic.port={critic_port}",
        f"remote.reward_model.ip={cfg.host}",
        f"remote.reward_model.port={rm_port}",
        "remote.pad_to_length=64",
        f"exp.output_dir={run_dir / 'ppo'}",
        "exp.task_scorer=sorting",
        "exp.keep_last=1",
    ]


def _write_config(path: Path, command: str, overrides: Sequence[str]) -> Path:
    """Resolve ``overrides`` against the command's schema and write the full YAML."""
    import importlib

    from openaligner.cli.main import COMMANDS
    from openaligner.config import load_config, save_config

    module = importlib.import_module(COMMANDS[command][0])
    save_config(load_config(module.SCHEMA, None, list(overrides)), path)
    return path


def _run_command(command: str, yaml_path: Path) -> None:
    """Run ``openaligner <command> <yaml>`` in this process, as the command line does."""
    from openaligner.cli.main import main

    rc = main([command, str(yaml_path)])
    if rc in (130, 143):  # the command was stopped by SIGINT or SIGTERM (train-ppo says so itself)
        raise KeyboardInterrupt
    if rc != 0:
        raise RuntimeError(f"`openaligner {command} {yaml_path}` failed with exit code {rc}")


# ---------------------------------------------------------------------- servers
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _start_server(command: str, yaml_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    log = log_path.open("wb")
    # A session of its own: Ctrl-C in the terminal reaches the demo, which then stops the servers
    # in order, instead of hitting every process at once.
    return subprocess.Popen(
        [sys.executable, "-m", "openaligner", command, str(yaml_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_ready(
    host: str, port: int, model: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> None:
    url = f"http://{host}:{port}/v2/models/{model}/ready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"the server for {model} exited with code {proc.returncode}; log {log_path}:\n{tail}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready after {timeout_s:.0f} s; see {log_path}")


def _stop_servers(servers: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    for p in servers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in servers:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# ---------------------------------------------------------------------- evaluation and report
def _evaluate(run_dir: Path, cfg: DemoConfig, rm_port: int) -> dict[str, dict[str, float]]:
    """Gold score, reward-model score, KL to the SFT policy and length, before and after PPO."""
    import torch

    from openaligner.clients.reward import RemoteGPTRMClient, RemoteRMConfig
    from openaligner.models.actor import GPTActorModel
    from openaligner.models.generation import SamplingParams
    from openaligner.models.tokenizers import load_tokenizer
    from openaligner.tasks.sorting import gold_score
    from openaligner.trainer.rollout import make_prompt_collate

    tokenizer = load_tokenizer(run_dir / "tokenizer")
    prompts = [
        json.loads(x)["prompt"] for x in (run_dir / "data" / "val_prompts.jsonl").read_text().splitlines()
    ]
    prompts = prompts[: cfg.eval_samples]
    bos = [tokenizer.bos_token_id]
    ids = [bos + tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    batch = make_prompt_collate(0)(ids)
    sft = GPTActorModel.from_pretrained(run_dir / "sft", init_policy=False)
    ppo = GPTActorModel.from_pretrained(run_dir / "ppo" / "actor", init_policy=False)
    sampled = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=1)
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW_TOKENS)
    for scorer in (sft, ppo):  # the KL below scores the distribution sampled from
        scorer.set_sampling(sampled)
    rm_cfg = RemoteRMConfig(ip=cfg.host, port=rm_port, pad_to_length=64)
    results: dict[str, dict[str, float]] = {}
    with RemoteGPTRMClient(rm_cfg) as rm:
        for name, actor in (("sft", sft), ("ppo", ppo)):
            out = actor.infer(batch, generator=torch.Generator().manual_seed(cfg.seed + 17))
            texts = _responses(out, tokenizer)
            lengths = out["response_lengths"]
            tokens, prompt_lengths = out["response_tokens"], out["prompt_lengths"]
            logp = actor.get_inference_log_probs(tokens, lengths, None, prompt_lengths)
            logp_sft = sft.get_inference_log_probs(tokens, lengths, None, prompt_lengths)
            mask = _mask(out)
            kl = ((logp - logp_sft) * mask).sum(-1).mean().item()
            greedy_out = actor.infer(batch, greedy)
            results[name] = {
                "gold": sum(gold_score(p, r) for p, r in zip(prompts, texts, strict=True)) / len(prompts),
                "gold_greedy": sum(
                    gold_score(p, r) for p, r in zip(prompts, _responses(greedy_out, tokenizer), strict=True)
                )
                / len(prompts),
                "rm_score": float(rm.infer_rm(out).result().mean()),
                "kl_to_sft": kl,
                "response_tokens": float((lengths - out["prompt_lengths"]).float().mean()),
                "properly_ended": float(out["is_end"].float().mean()),
            }
    return results


def _responses(out: dict[str, Any], tokenizer: Any) -> list[str]:
    texts = []
    for i in range(out["response_tokens"].shape[0]):
        p, end = int(out["prompt_lengths"][i]), int(out["response_lengths"][i])
        texts.append(tokenizer.decode(out["response_tokens"][i, p:end].tolist(), skip_special_tokens=True))
    return texts


def _mask(out: dict[str, Any]) -> Any:
    from openaligner.algorithms import response_mask

    width = out["response_tokens"].shape[1] - 1
    return response_mask(out["prompt_lengths"], out["response_lengths"], width)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_metrics(path: Path, prefix: str) -> dict[str, float]:
    rows = [r for r in _read_jsonl(path) if any(k.startswith(prefix) for k in r)]
    return {k: v for k, v in rows[-1].items() if k.startswith(prefix)} if rows else {}


def _plot(metrics: list[dict[str, Any]], path: Path) -> Path | None:
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rollout/score", "gold score of rollouts (0–100)"),
        ("rollout/rewards", "learned reward-model score"),
        ("rollout/init_policy_kl", "KL to the SFT policy (per token)"),
        ("rollout/generation_length", "response length (tokens)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        pts = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1.5)
        val_key = key.replace("rollout/", "val/")
        vpts = [(m["step"], m[val_key]) for m in metrics if m.get(val_key) is not None]
        if vpts:
            ax.plot(*zip(*vpts, strict=True), "o--", lw=1, label="validation")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_report(
    run_dir: Path,
    report: dict[str, dict[str, float]],
    rm_metrics: dict[str, float],
    seconds: dict[str, float],
    plot: Path | None,
    cfg: DemoConfig,
) -> None:
    sft, ppo = report["sft"], report["ppo"]
    rows = [
        ("gold score, sampled (0–100)", "gold"),
        ("gold score, greedy", "gold_greedy"),
        ("reward-model score", "rm_score"),
        ("KL to the SFT policy (nats / response)", "kl_to_sft"),
        ("response length (tokens)", "response_tokens"),
        ("properly ended", "properly_ended"),
    ]
    lines = [
        "# openaligner demo report",
        "",
        f"Seed {cfg.seed}, {'quick' if cfg.quick else 'full'} mode, {cfg.eval_samples} held-out prompts.",
        "",
        "| metric | SFT policy | PPO policy |",
        "|---|---|---|",
        *[f"| {label} | {sft[k]:.3f} | {ppo[k]:.3f} |" for label, k in rows],
        "",
        f"Gold-score gain: **{ppo['gold'] - sft['gold']:+.1f} points** (sampled).",
        "",
        "Reward model on held-out pairs: "
        + ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in rm_metrics.items()),
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in seconds.items()],
        "",
    ]
    if plot is not None:
        lines += [f"![PPO curves]({plot.name})", ""]
    lines += [
        "## Re-run any stage on its own",
        "",
        "```bash",
        f"openaligner train-sft {run_dir / 'configs' / 'sft.yaml'}",
        f"openaligner train-rm {run_dir / 'configs' / 'rm.yaml'}",
        f"openaligner serve-reward {run_dir / 'configs' / 'serve_reward.yaml'} &",
        f"openaligner serve-critic {run_dir / 'configs' / 'serve_critic.yaml'} &",
        f"openaligner train-ppo {run_dir / 'configs' / 'ppo.yaml'}",
        "```",
        "",
    ]
    (run_dir / "report.md").write_text("\n".join(lines))
    (run_dir / "report.json").write_text(
        json.dumps({"eval": report, "rm": rm_metrics, "seconds": seconds}, indent=1)
    )


def _print_summary(
    console: Console,
    report: dict[str, dict[str, float]],
    rm: dict[str, float],
    seconds: dict[str, float],
    run_dir: Path,
) -> None:
    table = Table(title="openaligner demo: SFT policy vs PPO policy on held-out prompts")
    table.add_column("metric")
    table.add_column("SFT", justify="right")
    table.add_column("PPO", justify="right")
    for label, key in [
        ("gold score (0–100)", "gold"),
        ("gold score, greedy", "gold_greedy"),
        ("reward-model score", "rm_score"),
        ("KL to SFT (nats)", "kl_to_sft"),
        ("response tokens", "response_tokens"),
    ]:
        table.add_row(label, f"{report['sft'][key]:.2f}", f"{report['ppo'][key]:.2f}")
    console.print(table)
    gain = report["ppo"]["gold"] - report["sft"]["gold"]
    color = "green" if gain > 0 else "red"
    console.print(
        f"gold-score gain [bold {color}]{gain:+.1f}[/] points; total {seconds.get('total', 0):.0f} s"
    )
    console.print(f"report: {run_dir / 'report.md'}")


def _banner(console: Console, n: int, text: str) -> None:
    console.rule(f"[bold cyan]stage {n}/6[/]  {text}")
