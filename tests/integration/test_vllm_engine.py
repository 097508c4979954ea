"""The vllm rollout engine for real (marker ``vllm``; needs the rollout environment of
``make rollout-setup``, and is skipped naming it when it is absent): after a weight push the
engine's greedy continuations and log-probs are the trainer's own and differ from before; train-ppo
runs with it end to end (and resumes, re-syncing the weights) leaving no engine process; a LoRA
policy arrives with its adapters merged; two FSDP ranks under torchrun share one engine; an
engine killed mid-run stops the trainer with a message naming it.

Tolerance: float32 on both sides; vLLM's CPU kernels sum in another order than PyTorch's, so the
log-probs of the same tokens agree to LOGPROB_ATOL (measured: ~1e-5) and greedy tokens are equal.
The tiny models have head size 32: vLLM's CPU attention refuses 16, the default tiny size's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from test_train_ppo import CriticServer, _prompts

from openaligner.algorithms import response_mask
from openaligner.cli.main import main
from openaligner.io.metrics import read_jsonl
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.generation import SamplingParams
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.rollout.engine import RolloutEngineError, RolloutRequest, row_seeds
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.rollout.vllm_config import VLLMConfig
from openaligner.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = [pytest.mark.vllm, pytest.mark.heavy, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 2e-4
# head size 32; the char tokenizer's vocabulary, so that responses decode (stop strings)
SIZE = TinySize(vocab_size=100, hidden_size=64, num_layers=2, num_heads=2)
LENGTHS = torch.tensor([4, 7, 2, 6])


@pytest.fixture(scope="module")
def rollout_python() -> str:
    """The rollout environment's interpreter ($OPENALIGNER_ROLLOUT_PYTHON, else .venv-rollout)."""
    env = os.environ.get("OPENALIGNER_ROLLOUT_PYTHON")
    path = Path(env) if env else ROOT / ".venv-rollout" / "bin" / "python"
    if not path.exists():
        pytest.skip(
            f"no rollout environment at {path}: run `make rollout-setup` (or set OPENALIGNER_ROLLOUT_PYTHON)"
        )
    return str(path)


def engine_processes(parent: int) -> list[int]:
    """Pids of live vllm engine processes started by process ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(") ")[-1][0]
        except OSError:
            continue
        if state != "Z" and b"--parent-pid=%d" % parent in cmd and any(b"vllm_worker.py" in c for c in cmd):
            found.append(int(entry.name))
    return found


def _prompts_tensor() -> torch.Tensor:
    text = torch.randint(3, SIZE.vocab_size, (4, 7), generator=torch.Generator().manual_seed(0))
    text[torch.arange(7) >= LENGTHS.unsqueeze(-1)] = 0
    return text


def _trainer_logprobs(actor: CausalLMActor, out) -> tuple[torch.Tensor, torch.Tensor]:
    mine = actor.get_inference_log_probs(out.tokens, out.sequence_lengths, prompt_lengths=out.prompt_lengths)
    mask = response_mask(out.prompt_lengths, out.sequence_lengths, out.tokens.shape[1] - 1).bool()
    return mine, mask


# qwen2 ties its LM head to the embedding; collective: the weights broadcast over a gloo group
@pytest.mark.parametrize(
    ("arch", "transfer"), [("llama", "auto"), ("qwen2", "auto"), ("qwen2", "collective")]
)
def test_after_a_weight_push_the_engine_generates_the_trainers_tokens_and_logprobs(
    rollout_python, arch, transfer
):
    actor = CausalLMActor(
        build_tiny_causal_lm(arch, SIZE, seed=0),
        sampling=SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(1,)),
        init_policy=False,
    )
    prompts = _prompts_tensor()
    greedy = RolloutRequest(prompts, LENGTHS, actor.sampling, row_seeds(0, 4))
    engine = VLLMRolloutEngine(
        actor, VLLMConfig(python=rollout_python, start_timeout_s=900, weight_transfer=transfer)
    )
    with engine:
        before = engine.generate(greedy)
        reference = HFRolloutEngine(actor).generate(greedy)
        assert torch.equal(before.tokens, reference.tokens)
        assert torch.equal(before.sequence_lengths, reference.sequence_lengths)
        assert torch.equal(before.is_end, reference.is_end)
        mine, mask = _trainer_logprobs(actor, before)
        assert before.logprobs is not None
        assert torch.allclose(before.logprobs[mask], mine[mask], atol=LOGPROB_ATOL, rtol=0)

        # a malformed request is answered 400, naming the field, and the engine goes on serving
        bad = urllib.request.Request(
            engine.url + "/generate", data=json.dumps({"prompts": [[5, 6]], "seeds": []}).encode()
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=60)
        assert (
            refused.value.code == 400
            and "seeds must hold one seed per prompt" in refused.value.read().decode()
        )
        # a prompt with no room for max_tokens in the engine's window: vLLM's own check would be a
        # 500 (a full window) or a response cut short unfinished; the worker refuses it, naming the keys
        with urllib.request.urlopen(engine.url + "/info", timeout=60) as r:
            window = json.loads(r.read())["max_model_len"]
        assert isinstance(window, int) and window > 0
        long_prompt = {
            "prompts": [[5] * (window - 3)],
            "seeds": [0],
            "greedy": True,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "max_tokens": 4,
            "min_tokens": 0,
            "stop_token_ids": [1],
        }
        over = urllib.request.Request(engine.url + "/generate", data=json.dumps(long_prompt).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(over, timeout=60)
        assert refused.value.code == 400 and f"max_model_len={window}" in refused.value.read().decode()

        # new weights: the engine must generate from them after the push, and only then
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in actor.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        engine.update_weights(actor, 1)
        engine.update_weights(actor, 2)  # two steps, one push
        after = engine.generate(greedy)
        assert set(engine.pop_metrics()) == {"timing/weight_sync_s"} and engine.pop_metrics() == {}
        reference = HFRolloutEngine(actor).generate(greedy)
        assert torch.equal(after.tokens, reference.tokens)
        mine, mask = _trainer_logprobs(actor, after)
        assert after.logprobs is not None
        assert torch.allclose(after.logprobs[mask], mine[mask], atol=LOGPROB_ATOL, rtol=0)
        assert not torch.equal(after.tokens, before.tokens)
        stats = engine.check_logprobs(after.logprobs, mine, mask.float())
        assert stats["logprob_diff_max"] < LOGPROB_ATOL and stats["token_prob_error"] < 1 + LOGPROB_ATOL

        # sampling: each row has its own seeded stream (batch-mates do not change it); the
        # log-probs of sampled tokens are the trainer's at the sampling temperature
        actor.set_sampling(SamplingParams(temperature=0.8, max_new_tokens=8, stop_token_ids=(1,)))
        sampled = RolloutRequest(prompts, LENGTHS, actor.sampling, row_seeds(7, 4))
        first = engine.generate(sampled)
        assert torch.equal(engine.generate(sampled).tokens, first.tokens)
        alone = engine.generate(RolloutRequest(prompts[2:3], LENGTHS[2:3], actor.sampling, row_seeds(9, 1)))
        n = int(alone.sequence_lengths[0])
        assert torch.equal(alone.tokens[0, :n], first.tokens[2, :n])
        mine, mask = _trainer_logprobs(actor, first)
        assert first.logprobs is not None
        assert torch.allclose(first.logprobs[mask], mine[mask], atol=LOGPROB_ATOL, rtol=0)

        # stop strings: the engine cannot match them while sampling (it has no tokenizer); each
        # response is cut where the hf engine's loop ends it, and counts as ended
        tok = build_char_tokenizer()
        actor.tokenizer = engine.tokenizer = tok
        plain = SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(1,))
        free = engine.generate(RolloutRequest(prompts, LENGTHS, plain, row_seeds(0, 4)))
        p0 = int(LENGTHS[0])
        stop = tok.decode(free.tokens[0, p0 + 2 : p0 + 4].tolist())
        assert len(stop) == 2 and int(free.sequence_lengths[0]) >= p0 + 4
        stopping = dataclasses.replace(plain, stop_strings=(stop,))
        request = RolloutRequest(prompts, LENGTHS, stopping, row_seeds(0, 4))
        cut, reference = engine.generate(request), HFRolloutEngine(actor).generate(request)
        assert torch.equal(cut.tokens, reference.tokens)
        assert torch.equal(cut.sequence_lengths, reference.sequence_lengths)
        assert torch.equal(cut.is_end, reference.is_end)
        assert cut.is_end[0] and int(cut.sequence_lengths[0]) <= p0 + 4
        assert cut.logprobs is not None and cut.logprobs.shape[1] == cut.tokens.shape[1] - 1

        # weights that did not arrive: the trainer's change after the push stands for a push the
        # engine missed; the first rollout after a push is checked, and the run stops
        engine.update_weights(actor, 3)
        stale = engine.generate(sampled)
        with torch.no_grad():
            for p in actor.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        mine, mask = _trainer_logprobs(actor, stale)
        assert stale.logprobs is not None
        with pytest.raises(RolloutEngineError, match=r"not generating from the trainer's weights"):
            engine.check_logprobs(stale.logprobs, mine, mask.float())
    assert engine_processes(os.getpid()) == []


def _ppo_args(out: Path, prompts: Path, port: int, steps: int, python: str) -> list[str]:
    return [
        "train-ppo",
        "actor.tiny=llama",
        "actor.tiny_hidden_size=64",
        "actor.tiny_num_layers=1",
        "actor.tiny_num_heads=2",  # head size 32
        "actor.tiny_seed=1",
        "device=cpu",
        f"data.train_path={prompts}",
        "data.seq_length=64",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=5",
        "trainer.num_rollout_samples=16",
        "trainer.rollout_micro_batch_size=8",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0",
        "trainer.save_interval=1",
        "trainer.length.max_length=6",
        "trainer.initial_policy_kl_penalty=0.05",
        "trainer.seed=3",
        "optim.lr=1e-3",
        f"remote.critic.port={port}",
        "remote.pad_to_length=32",
        f"exp.output_dir={out}",
        "exp.progress=false",
        "exp.tensorboard=false",
        "rollout.engine=vllm",
        f"rollout.vllm.python={python}",
        "rollout.vllm.start_timeout_s=900",
    ]


def test_train_ppo_with_the_vllm_engine_runs_resumes_and_leaves_no_engine(rollout_python, tmp_path):
    server = CriticServer(tmp_path / "critic", tmp_path / "critic.log")
    prompts = _prompts(tmp_path / "p.jsonl")
    run = tmp_path / "run"
    try:
        torch.set_num_threads(2)
        # with truncated importance sampling on the engine/trainer ratio (~1 here: same weights)
        assert main([*_ppo_args(run, prompts, server.port, 2, rollout_python), "trainer.tis_cap=2"]) == 0
        assert engine_processes(os.getpid()) == []
        # resume: the restored weights go to a fresh engine before step 3's rollouts
        args = _ppo_args(run, prompts, server.port, 3, rollout_python)
        assert main([*args, "exp.resume=true", "trainer.tis_cap=2"]) == 0
        assert engine_processes(os.getpid()) == []
    finally:
        server.stop()
    rows = read_jsonl(run / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 1 samples from the weights the engine started with; steps 2 and 3 after a push
    assert "timing/weight_sync_s" not in rows[0]
    assert all(r["timing/weight_sync_s"] > 0 for r in rows[1:])
    for r in rows:
        assert r["rollout/engine_logprob_diff_max"] < LOGPROB_ATOL, r
        assert 1.0 <= r["rollout/engine_token_prob_error"] < 1 + LOGPROB_ATOL
        assert r["policy/loss"] is not None
        assert abs(r["rollout/tis_weight_mean"] - 1) < LOGPROB_ATOL
        assert r["rollout/tis_truncated_fraction"] == 0


def test_an_engine_killed_mid_run_stops_the_trainer_naming_the_engine(rollout_python, tmp_path):
    server = CriticServer(tmp_path / "critic", tmp_path / "critic.log")
    run = tmp_path / "run"
    args = _ppo_args(run, _prompts(tmp_path / "p.jsonl"), server.port, 50, rollout_python)
    log = (tmp_path / "trainer.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "openaligner", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        metrics = run / "logs" / "metrics.jsonl"
        deadline = time.monotonic() + 900
        while not (metrics.exists() and metrics.read_text().strip()):  # a step has run on the engine
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()
            assert time.monotonic() < deadline, "no step within 900 s"
            time.sleep(1.0)
        [engine] = engine_processes(proc.pid)
        os.kill(engine, signal.SIGKILL)
        assert proc.wait(timeout=300) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        server.stop()
    text = (tmp_path / "trainer.log").read_text()
    assert "RolloutEngineError: the vllm rollout engine died" in text, text[-3000:]
    assert "killed by signal 9" in text
    assert engine_processes(proc.pid) == []


def test_a_lora_policy_reaches_the_engine_with_its_adapters_merged_pushing_only_what_they_change(
    rollout_python,
):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    actor = CausalLMActor(
        peft.get_peft_model(build_tiny_causal_lm("llama", SIZE, seed=0), config),
        sampling=SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(1,)),
        init_policy=False,
    )
    greedy = RolloutRequest(_prompts_tensor(), LENGTHS, actor.sampling, row_seeds(0, 4))
    with VLLMRolloutEngine(actor, VLLMConfig(python=rollout_python, start_timeout_s=900)) as engine:
        written: list[set[str]] = []  # the names of each file pushed to the engine
        write = engine._write_weights
        engine._write_weights = lambda d, state: (written.append(set(state)), write(d, state))[1]
        before = engine.generate(greedy)
        assert torch.equal(before.tokens, HFRolloutEngine(actor).generate(greedy).tokens)
        outputs = [before.tokens]
        for version in (1, 2):  # two pushes: the second onto an engine the first changed in part
            with torch.no_grad():  # an update of the adapters alone
                g = torch.Generator().manual_seed(1 + version)
                for name, p in actor.model.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn(p.shape, generator=g))
            engine.update_weights(actor, version)
            after = engine.generate(greedy)
            assert torch.equal(after.tokens, HFRolloutEngine(actor).generate(greedy).tokens)
            assert not torch.equal(after.tokens, outputs[-1])
            outputs.append(after.tokens)
            mine, mask = _trainer_logprobs(actor, after)
            assert after.logprobs is not None
            assert torch.allclose(after.logprobs[mask], mine[mask], atol=LOGPROB_ATOL, rtol=0)
        # after the whole weights at the start (written before the recording began), each push
        # holds only the attention blocks the adapters are on (q and v adapted; k and o too, as
        # vLLM loads q/k/v as one qkv layer)
        whole = set(actor.inference_state_dict() or {})
        assert "model.embed_tokens.weight" in whole and len(written) == 2
        for names in written:
            assert names == {n for n in whole if ".self_attn." in n and n.endswith("_proj.weight")}


def _all_engines() -> set[int]:
    """Pids of every live vllm engine process on this machine."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"vllm_worker.py" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def test_train_ppo_under_torchrun_with_fsdp_shares_one_engine(rollout_python, tmp_path):
    server = CriticServer(tmp_path / "critic", tmp_path / "critic.log")
    run = tmp_path / "run"
    args = _ppo_args(run, _prompts(tmp_path / "p.jsonl"), server.port, 2, rollout_python)
    before = _all_engines()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    try:
        done = subprocess.run(
            [*torchrun, "-m", "openaligner", *args, "parallel.strategy=fsdp"],
            capture_output=True,
            text=True,
            timeout=1500,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        server.stop()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert _all_engines() - before == set()
    rows = read_jsonl(run / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["timing/weight_sync_s"] > 0  # the FSDP shards, gathered and pushed
    for r in rows:
        assert r["rollout/engine_logprob_diff_max"] < LOGPROB_ATOL, r
        assert r["rollout/rollout_size"] == 16  # both ranks' rows, generated by the one engine


TRAINER_THAT_HANGS = """
import sys, time
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.rollout.vllm_config import VLLMConfig
from openaligner.rollout.vllm_engine import VLLMRolloutEngine

size = TinySize(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2)
actor = CausalLMActor(build_tiny_causal_lm("llama", size), init_policy=False)
VLLMRolloutEngine(actor, VLLMConfig(python=sys.argv[1], start_timeout_s=900)).start()
print("engine up", flush=True)
time.sleep(3600)
"""


def test_a_trainer_killed_with_sigkill_leaves_no_engine(rollout_python, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_THAT_HANGS)
    proc = subprocess.Popen([sys.executable, str(script), rollout_python], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "engine up"
        engines = engine_processes(proc.pid)
        assert len(engines) == 1
        cmd = Path(f"/proc/{engines[0]}/cmdline").read_bytes().split(b"\0")
        [workdir] = [Path(c.decode().removeprefix("--workdir=")) for c in cmd if c.startswith(b"--workdir=")]
        assert workdir.is_dir()
    finally:
        proc.kill()  # no chance to stop the engine: it notices its parent is gone
        proc.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in engines):
        assert time.monotonic() < deadline, "the engine outlived its trainer by 30 s"
        time.sleep(0.5)
    assert not workdir.exists()  # the weights in shared memory went with it


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False
