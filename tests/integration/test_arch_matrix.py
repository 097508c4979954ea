"""The architecture matrix: every tiny architecture through the whole pipeline a user runs.

For each architecture of ``TINY_ARCHS``, starting from a Hugging Face directory with its own
trained BPE tokenizer (``arch_zoo.py``): ``train-sft`` → ``train-rm`` from the SFT model →
``serve-critic`` over the reward model (combined: it serves the rewards too; for the archs in
``SEPARATE_REWARD_SERVER`` a ``serve-reward`` next to a values-only critic) → ``train-ppo`` for one
step with a checkpoint → the servers stopped and started again (the critic resumes from its
checkpoint) → ``train-ppo`` resumed to step 2 → the final actor reloaded with plain
``AutoModelForCausalLM.from_pretrained`` gives the trained actor's logits. The train commands run
in-process (``openaligner.cli.main.main``), the servers as the user starts them.

Cost. Server start-up is most of it (≈ 10 s each on 2 cores, 22 starts), so the architectures'
pipelines are generators, interleaved by :func:`run_interleaved`: while one architecture's
commands run, the servers of up to ``MAX_STARTING`` others start. The whole matrix runs once per
module (the ``matrix`` fixture); each architecture's checks are a test of their own.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_zoo import FAMILIES, TASK, Family, render_prompt, save_model_dir, write_task_files
from procs import Served, free_port
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from openaligner.cli.main import main
from openaligner.data.render import SequenceLayout, with_bos, with_eos
from openaligner.io.metrics import read_jsonl
from openaligner.models.builders import TINY_ARCHS
from openaligner.models.tokenizers import load_tokenizer
from openaligner.trainer import ppo_recipe

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # minutes: the second CI step (make test-heavy)

SEPARATE_REWARD_SERVER = ("gpt2", "gemma2")
"""Archs served by serve-reward + a values-only serve-critic; the others by one combined critic."""

MAX_STARTING = 4  # architectures whose servers start at the same time
READY_TIMEOUT_S = 180.0  # per server start, on a loaded machine
LOGITS_ATOL = 1e-5  # reloaded vs trained actor (observed: bitwise equal on CPU)

# Config keys that legitimately differ between the model a user brought and what a command wrote.
_WRITTEN_KEYS = {
    "_name_or_path",
    "architectures",
    "dtype",
    "transformers_version",
    "num_labels",
    "id2label",
    "label2id",
}

ServerCommands = list[list[str]]  # argv of each server to start
Pipeline = Generator[ServerCommands, list[Served], "ArchRun"]


@dataclass
class ArchRun:
    """What one architecture's pipeline did, for its test to check."""

    arch: str
    root: Path
    exit_codes: dict[str, int] = field(default_factory=dict)  # command → exit code
    checkpoints_after_first_run: list[str] = field(default_factory=list)
    resume_log: list[str] = field(default_factory=list)  # train-ppo's resume messages (second run)
    first_servers: list[Served] = field(default_factory=list)
    restarted_servers: list[Served] = field(default_factory=list)
    rewards_of_text_and_tokens: tuple[float, float] = (float("nan"), float("nan"))  # one sequence, served
    logits_max_diff: float = float("nan")  # reloaded vs trained actor
    logits_moved: float = float("nan")  # trained actor vs the SFT model (PPO changed the policy)
    loading_info: dict[str, list[str]] = field(default_factory=dict)  # from_pretrained's, of the actor


def _sft_args(family: Family, base: Path, data: Path, out: Path) -> list[str]:
    return [
        "train-sft",
        f"model.path={base}",
        f"data.train_path={data}",
        f"output_dir={out}",
        "device=cpu",
        "progress=false",
        "trainer.max_steps=60",  # enough for most sampled responses to end on the EOS token
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8",
        "trainer.val_check_interval=0",
        "trainer.save_interval=0",
        "optim.lr=3e-3",
    ]


def _rm_args(family: Family, sft: Path, data: Path, out: Path) -> list[str]:
    return [
        "train-rm",
        f"model.path={sft}",
        f"data.train_path={data}",
        f"output_dir={out}",
        "device=cpu",
        "progress=false",
        "trainer.max_steps=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0",
        "trainer.save_interval=0",
        "optim.lr=1e-3",
    ]


def _server_commands(arch: str, rm: Path, critic_dir: Path) -> tuple[ServerCommands, dict[str, int]]:
    """The servers' argv and the train-ppo ports: one combined critic, or critic + reward server."""
    combined = arch not in SEPARATE_REWARD_SERVER
    critic_port = free_port()
    critic = [
        sys.executable,
        "-m",
        "openaligner",
        "serve-critic",
        f"model.path={rm}",  # the tokenizer comes from the same directory
        f"server.port={critic_port}",
        f"server.combine_rm_and_critic_server={str(combined).lower()}",
        "server.inference_micro_batch_size=[4]",
        "server.model_forward_micro_batch_size=4",
        f"checkpoint.dir={critic_dir}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "threads=1",
    ]
    if combined:
        return [critic], {"critic": critic_port}
    reward_port = free_port()
    reward = [
        sys.executable,
        "-m",
        "openaligner",
        "serve-reward",
        f"model.path={rm}",
        f"server.port={reward_port}",
        "threads=1",
    ]
    return [critic, reward], {"critic": critic_port, "reward": reward_port}


def _ppo_args(sft: Path, prompts: Path, out: Path, ports: dict[str, int], steps: int) -> list[str]:
    remote = [f"remote.critic.port={ports['critic']}"]
    if "reward" in ports:
        remote += ["remote.combine_rm_and_critic_server=false", f"remote.reward_model.port={ports['reward']}"]
    return [
        "train-ppo",
        f"actor.path={sft}",
        "device=cpu",
        f"data.train_path={prompts}",
        "data.seq_length=48",
        f"trainer.max_steps={steps}",
        "trainer.num_rollout_samples=8",
        "trainer.rollout_micro_batch_size=4",  # two micro-batches in flight to the servers
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",  # gradient accumulation over two
        "trainer.num_val_samples=4",
        "trainer.val_rollout_micro_batch_size=4",
        "trainer.val_check_interval=1",
        "trainer.save_interval=1",
        "trainer.length.max_length=8",  # prompt + response run past the sliding window (8)
        "trainer.seed=5",
        "optim.lr=1e-3",
        *remote,
        "remote.pad_to_length=48",
        f"exp.output_dir={out}",
        "exp.progress=false",
        "exp.tensorboard=false",
    ]


def arch_pipeline(arch: str, root: Path) -> Pipeline:
    """One architecture from its HF directory to a resumed PPO run, as a user runs it. Yields the
    servers to start and receives them once they answer; returns what happened."""
    family = FAMILIES[arch]
    run = ArchRun(arch, root)
    base, sft, rm, ppo = root / "base", root / "sft", root / "rm", root / "ppo"
    tokenizer = save_model_dir(family, base)
    data = write_task_files(family, tokenizer, root)
    # 1. SFT from the user's directory, the reward model from the SFT model
    run.exit_codes["train-sft"] = main(_sft_args(family, base, data["sft"], sft))
    run.exit_codes["train-rm"] = main(_rm_args(family, sft, data["pairs"], rm))
    if run.exit_codes["train-sft"] or run.exit_codes["train-rm"]:
        return run
    # 2. serve, and one PPO step with its checkpoint (actor and critic)
    commands, ports = _server_commands(arch, rm, root / "critic")
    run.first_servers = yield commands
    run.exit_codes["train-ppo"] = main(_ppo_args(sft, data["prompts"], ppo, ports, steps=1))
    run.checkpoints_after_first_run = sorted(p.name for p in (ppo / "checkpoints").glob("step_*"))
    run.rewards_of_text_and_tokens = _served_rewards(arch, run.first_servers, rm, data["sft"])
    # 3. the servers stopped and started again: the critic resumes from its checkpoint
    _stop(run.first_servers)
    commands, ports = _server_commands(arch, rm, root / "critic")
    run.restarted_servers = yield commands
    trained: list[PreTrainedModel] = []
    with _keeping_the_trained_actor(trained), _log_lines("openaligner.trainer") as resume_log:
        run.exit_codes["train-ppo resumed"] = main(_ppo_args(sft, data["prompts"], ppo, ports, steps=2))
    run.resume_log = resume_log
    _stop(run.restarted_servers)
    # 4. the final actor as plain transformers loads it, against the trained actor in memory
    if trained:
        reloaded, info = AutoModelForCausalLM.from_pretrained(ppo / "actor", output_loading_info=True)
        run.loading_info = {k: list(v) for k, v in info.items() if k != "error_msgs"}
        sft_model = AutoModelForCausalLM.from_pretrained(sft)
        tokens, mask = _prompt_batch(family, ppo / "actor")
        final = _logits(trained[0], tokens, mask)
        run.logits_max_diff = float((_logits(reloaded, tokens, mask) - final).abs().max())
        run.logits_moved = float((_logits(sft_model, tokens, mask) - final).abs().max())
    return run


def _served_rewards(arch: str, servers: list[Served], rm: Path, sft_data: Path) -> tuple[float, float]:
    """The reward the server gives one SFT example sent as text (tokenized by the server, with the
    tokenizer of the reward model's directory) and as the token ids of that tokenizer."""
    example = json.loads(sft_data.read_text().splitlines()[0])
    tokenizer = load_tokenizer(rm)
    layout = SequenceLayout.load(rm)
    assert layout is not None  # train-rm records how it laid out its sequences
    if layout.chat_template:  # a sentence is the conversation as the template renders it
        turns = [
            {"role": "user", "content": example["prompt"]},
            {"role": "assistant", "content": example["response"]},
        ]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
        assert isinstance(text, str)
        text = text.rstrip()
    else:
        text = example["prompt"] + " " + example["response"]
    bos, eos = layout.special_ids(tokenizer)
    ids = with_eos(with_bos(tokenizer(text, add_special_tokens=False)["input_ids"], bos), eos)
    separate = arch in SEPARATE_REWARD_SERVER
    url = (servers[1] if separate else servers[0]).wait_ready()
    name = "reward_model" if separate else "critic_infer"
    by_text = [{"name": "sentences", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]
    by_tokens = [
        {"name": "tokens", "datatype": "INT64", "shape": [1, len(ids)], "data": ids},
        {"name": "sequence_lengths", "datatype": "INT64", "shape": [1, 1], "data": [len(ids)]},
    ]
    return _infer_reward(url, name, by_text), _infer_reward(url, name, by_tokens)


def _infer_reward(url: str, model: str, inputs: list[dict[str, Any]]) -> float:
    body = json.dumps({"inputs": inputs}).encode()
    request = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        outputs = json.loads(response.read())["outputs"]
    return float(next(o for o in outputs if o["name"] == "rewards")["data"][0])


_STOPPED: set[int] = set()
"""Pids already sent their SIGTERM: a second one while a server is still exiting (slow under load)
would end it with -15 instead of the clean exit the test checks."""


def _stop(servers: list[Served]) -> None:
    """SIGTERM, once per server (a graceful stop); their exit is collected at the end of the matrix."""
    for server in servers:
        if server.proc.poll() is None and server.proc.pid not in _STOPPED:
            _STOPPED.add(server.proc.pid)
            server.proc.send_signal(signal.SIGTERM)


@contextmanager
def _keeping_the_trained_actor(into: list[PreTrainedModel]) -> Iterator[None]:
    """train-ppo in-process, keeping its trained actor (the recipe's, after fit) in ``into``."""
    run_ppo = ppo_recipe.run_ppo

    def run_and_keep(run: ppo_recipe.PPORun, *args: Any, **kwargs: Any) -> None:
        run_ppo(run, *args, **kwargs)
        into.append(run.actor.model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ppo_recipe, "run_ppo", run_and_keep)
        yield


@contextmanager
def _log_lines(name: str) -> Iterator[list[str]]:
    """The messages logged under ``name`` inside the block."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.INFO)  # under pytest the root logger stays at WARNING
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _prompt_batch(family: Family, tokenizer_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight task prompts + the start of an answer, tokenized as train-ppo does, right-padded."""
    tokenizer = load_tokenizer(tokenizer_dir)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    texts = [render_prompt(family, tokenizer, r["prompt"]) + " 1 2" for r in TASK.val_prompts]
    rows = [bos + tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    tokens = torch.full((len(rows), max(map(len, rows))), int(tokenizer.pad_token_id))
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return tokens, mask


def _logits(model: PreTrainedModel, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask).logits
    return logits.float() * mask.unsqueeze(-1)  # padded positions are not compared


def run_interleaved(pipelines: dict[str, Pipeline], max_starting: int) -> dict[str, ArchRun | BaseException]:
    """Drive every pipeline to its end in this (the main) thread, starting the servers each asks
    for and resuming it once they all answer; at most ``max_starting`` pipelines wait for servers
    at a time, so the rest of the machine runs the others' commands meanwhile. A pipeline that
    raises, or whose server dies or never answers, ends with that exception as its result. Every
    server is stopped (and waited for) before this returns."""
    results: dict[str, ArchRun | BaseException] = {}
    queue = deque(pipelines)
    starting: dict[str, tuple[list[Served], float]] = {}  # arch → its servers, when they started
    started: list[Served] = []

    def advance(arch: str, servers: list[Served] | None) -> None:
        try:
            commands = pipelines[arch].send(servers)  # type: ignore[arg-type]  # None primes it
        except StopIteration as end:
            results[arch] = end.value
            return
        except Exception as e:  # reported by the architecture's own test
            results[arch] = e
            return
        new = [Served(command) for command in commands]
        started.extend(new)
        starting[arch] = (new, time.monotonic())

    try:
        while queue or starting:
            while queue and len(starting) < max_starting:
                advance(queue.popleft(), None)
            for arch, (servers, since) in list(starting.items()):
                try:
                    ready = all(server.ready_url() for server in servers)
                    if not ready and time.monotonic() - since > READY_TIMEOUT_S:
                        raise AssertionError(
                            f"not ready after {READY_TIMEOUT_S} s: {servers[0].output[-2000:]}"
                        )
                except AssertionError as e:
                    pipelines[arch].close()
                    results[arch] = e
                    del starting[arch]
                    continue
                if ready:
                    del starting[arch]
                    advance(arch, servers)
                    break  # the others' state changed while this one ran: look again
            else:
                time.sleep(0.05)
    finally:
        _stop(started)
        for server in started:
            try:
                server.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    return results


@pytest.fixture(scope="module")
def matrix(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ArchRun | BaseException]]:
    """Every selected architecture's pipeline (``-k mixtral`` runs one), interleaved."""
    selected = [
        item.callspec.params["arch"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the servers starting meanwhile need the other core
    t0 = time.monotonic()
    pipelines = {arch: arch_pipeline(arch, tmp_path_factory.mktemp(arch)) for arch in selected}
    try:
        results = run_interleaved(pipelines, MAX_STARTING)
    finally:
        torch.set_num_threads(threads)
    print(f"\narchitecture matrix: {len(selected)} architecture(s) in {time.monotonic() - t0:.0f} s")
    yield results


def _config(directory: Path) -> dict[str, Any]:
    config = AutoConfig.from_pretrained(directory, local_files_only=True).to_dict()
    return {k: v for k, v in config.items() if k not in _WRITTEN_KEYS}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_architecture_trains_serves_resumes_and_reloads(matrix, arch):
    result = matrix[arch]
    if isinstance(result, BaseException):
        raise result
    run = result
    ppo = run.root / "ppo"
    commands = ("train-sft", "train-rm", "train-ppo", "train-ppo resumed")
    assert run.exit_codes == dict.fromkeys(commands, 0), run.exit_codes
    # every output keeps the architecture the user brought (GQA, tied head, sliding window, experts...)
    base = _config(run.root / "base")
    for out in ("sft", "rm", "ppo/actor"):
        assert _config(run.root / out) == base, out
    rm_config = AutoConfig.from_pretrained(run.root / "rm", local_files_only=True)
    assert rm_config.architectures[0].endswith("ForSequenceClassification") and rm_config.num_labels == 1
    # the first run checkpointed step 1; the restarted critic resumed from it, and so did the actor
    assert run.checkpoints_after_first_run == ["step_1"]
    critic = run.restarted_servers[0]
    assert "step_1 at step 1" in critic.output, critic.output[-2000:]  # "critic resumed from ..."
    assert any("went back to critic step 1" in line for line in run.resume_log), run.resume_log
    # the servers found the tokenizer in the reward model's directory and tokenize as it does
    assert all("no tokenizer" not in server.output for server in run.first_servers)
    by_text, by_tokens = run.rewards_of_text_and_tokens
    assert by_text == pytest.approx(by_tokens, abs=1e-6)
    assert any("resumed from" in line and "at step 1" in line for line in run.resume_log), run.resume_log
    state = json.loads((ppo / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert (state["step"], state["consumed_samples"]) == (2, 16)
    rows = read_jsonl(ppo / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("rollout/rewards", "value/loss", "policy/loss", "val/rewards"):
            assert row[key] is not None and torch.isfinite(torch.tensor(row[key])), (row["step"], key)
    assert rows[0]["rollout/init_policy_kl"] == 0.0  # the initial policy is the policy at step 1
    # responses end on this tokenizer's EOS (so the policy gradient is not gated off)
    assert sum(r["rollout/fraction_of_samples_properly_ended"] for r in rows) > 0
    # every server stopped cleanly on SIGTERM
    for server in run.first_servers + run.restarted_servers:
        assert server.proc.returncode == 0, server.output[-2000:]
    # plain transformers reloads the final actor completely and computes the trained actor's logits
    assert run.loading_info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert run.logits_max_diff <= LOGITS_ATOL
    assert run.logits_moved > 1e-4  # PPO did change the policy, so the comparison is not vacuous
    if FAMILIES[arch].chat_template is not None:
        assert load_tokenizer(ppo / "actor").chat_template == FAMILIES[arch].chat_template
