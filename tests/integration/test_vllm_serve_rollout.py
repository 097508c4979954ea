"""``openaligner serve-rollout`` for real (markers ``vllm`` and ``heavy``; skipped, naming it, without
the rollout environment of ``make rollout-setup``): started as a user starts it, it serves one
attached trainer at a time; the first rollout of a run pushes the run's weights (uploaded over
HTTP, or written into the engine's directory on the same machine), after which the engine's
log-probs are the trainer's; train-ppo attached for 2 steps leaves it serving; SIGTERM ends it with
no process and no directory left.

The engine starts from another random initialisation (seed 5) than the actor (seed 1): log-probs
equal to the actor's can only come from a push. Tolerances as in test_vllm_engine.py.
"""

from __future__ import annotations

import json
import os
import re
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
from test_vllm_engine import LOGPROB_ATOL, _ppo_args, _trainer_logprobs, engine_processes, rollout_python

from openaligner.cli.main import main
from openaligner.io.metrics import read_jsonl
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.generation import SamplingParams
from openaligner.rollout.engine import EngineSetupError, RolloutRequest, row_seeds
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.rollout.vllm_config import VLLMConfig
from openaligner.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = [pytest.mark.vllm, pytest.mark.heavy, pytest.mark.slow]

__all__ = ["rollout_python"]  # the fixture, shared with test_vllm_engine.py

# train-ppo's actor in _ppo_args (actor.tiny=llama, 1 layer, 2 heads of 32, the char tokenizer's 100 ids)
SIZE = TinySize(vocab_size=100, hidden_size=64, num_layers=1, num_heads=2)
SPAWN_ONLY = ("rollout.vllm.python=", "rollout.vllm.start_timeout_s=")


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _start_serve_rollout(model: Path, python: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``openaligner serve-rollout`` as a user starts it; its URL from the line it prints."""
    [(proc, url)] = _start_serve_rollouts([(model, log)], python)
    return proc, url


def _start_serve_rollouts(
    engines: list[tuple[Path, Path]], python: str
) -> list[tuple[subprocess.Popen, str]]:
    """One ``openaligner serve-rollout`` per ``(model, log)``, all started at once; each process
    and its URL (from the line it prints)."""
    procs = []
    for model, log in engines:
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "openaligner",
                        "serve-rollout",
                        f"model={model}",
                        "server.port=0",
                        f"vllm.python={python}",
                        "vllm.start_timeout_s=900",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
    deadline = time.monotonic() + 900
    out = []
    for proc, (_, log) in zip(procs, engines, strict=True):
        while not (found := re.search(r"ready at (http://\S+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                pytest.fail(f"serve-rollout did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        out.append((proc, found.group(1)))
    return out


def _attached_ppo(tmp_path: Path, url: str, rollout_python: str) -> list[dict]:
    """train-ppo for 2 steps attached to the engine(s) at ``url`` (a served critic beside it);
    its metrics rows."""
    server = CriticServer(tmp_path / "critic", tmp_path / "critic.log")
    try:
        args = _ppo_args(tmp_path / "run", _prompts(tmp_path / "p.jsonl"), server.port, 2, rollout_python)
        args = [a for a in args if not a.startswith(SPAWN_ONLY)]
        torch.set_num_threads(2)
        assert main([*args, f"rollout.vllm.url={url}"]) == 0
    finally:
        server.stop()
    return read_jsonl(tmp_path / "run" / "logs" / "metrics.jsonl")


def test_serve_rollout_serves_one_attached_run_at_a_time_and_stops_cleanly(rollout_python, tmp_path):
    served = tmp_path / "served"
    build_tiny_causal_lm("llama", SIZE, seed=5).save_pretrained(served)
    log = tmp_path / "serve-rollout.log"
    proc, url = _start_serve_rollout(served, rollout_python, log)
    try:
        [worker] = engine_processes(proc.pid)
        cmd = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
        [workdir] = [Path(c.decode().removeprefix("--workdir=")) for c in cmd if c.startswith(b"--workdir=")]

        # bad requests: a 4xx naming what was wrong, and the engine goes on serving
        code, reply = _http(url + "/generate", {"prompts": [[5, 6]], "seeds": [0]})
        assert code == 409 and "POST /attach" in reply["error"], reply
        code, reply = _http(url + "/attach", {"local_token": None})
        assert code == 400 and "client must be a non-empty string" in reply["error"], reply
        assert _http(url + "/health") == (200, {"ok": True})

        # a run attached in this process, its weights uploaded over HTTP
        actor = CausalLMActor(
            build_tiny_causal_lm("llama", SIZE, seed=1),
            sampling=SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(1,)),
            init_policy=False,
        )
        start_weights = CausalLMActor(build_tiny_causal_lm("llama", SIZE, seed=5), init_policy=False)
        prompts = torch.randint(3, SIZE.vocab_size, (4, 7), generator=torch.Generator().manual_seed(0))
        lengths = torch.tensor([4, 7, 2, 6])
        greedy = RolloutRequest(prompts, lengths, actor.sampling, row_seeds(0, 4))
        with VLLMRolloutEngine(actor, VLLMConfig(url=url, weight_transfer="http")) as engine:
            # a second trainer is refused while the first holds the engine
            with pytest.raises(EngineSetupError, match=r"attached to another trainer"):
                VLLMRolloutEngine(actor, VLLMConfig(url=url))
            code, reply = _http(url + "/attach", {"client": "intruder"})
            assert code == 409 and "attached to another trainer" in reply["error"], reply

            out = engine.generate(greedy)  # the first rollout pushes the actor's weights
            assert engine.links[0].local_dir is None  # uploaded (weight_transfer=http)
            assert engine.pop_metrics()["timing/weight_sync_s"] > 0
            assert torch.equal(out.tokens, HFRolloutEngine(actor).generate(greedy).tokens)
            mine, mask = _trainer_logprobs(actor, out)
            assert out.logprobs is not None
            assert torch.allclose(out.logprobs[mask], mine[mask], atol=LOGPROB_ATOL, rtol=0)
            theirs, _ = _trainer_logprobs(start_weights, out)  # what the engine's start weights give
            assert (out.logprobs[mask] - theirs[mask]).abs().max() > 100 * LOGPROB_ATOL
        assert _http(url + "/info")[1]["lease"] is None  # detached, and still serving

        # train-ppo attached for 2 steps (same machine: through the engine's directory)
        rows = _attached_ppo(tmp_path, url, rollout_python)
        assert [r["step"] for r in rows] == [1, 2]
        # step 1 pushed the run's weights before its rollout (the engine held another model's)
        assert all(r["timing/weight_sync_s"] > 0 for r in rows)
        for r in rows:
            assert r["rollout/engine_logprob_diff_max"] < LOGPROB_ATOL, r
        assert proc.poll() is None and _http(url + "/health") == (200, {"ok": True})
        assert _http(url + "/info")[1]["lease"] is None
        text = log.read_text()
        assert "(same machine)" in text, text[-3000:]
        assert not (workdir / "weights" / "model.safetensors").exists()  # loaded, then removed

        # SIGTERM: the engine and its directory go
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "vllm rollout engine stopped" in log.read_text()
    assert engine_processes(proc.pid) == []
    assert not workdir.exists()


def test_one_run_shares_its_rollouts_among_two_engines_and_pushes_into_both(rollout_python, tmp_path):
    """``rollout.vllm.url=A,B``: each engine draws a share of every rollout; after the push both
    give the trainer's log-probs (each starts from its own random initialisation, neither the
    actor's); sampled rows are the same as from one engine (a row's stream is its seed's); train-ppo
    attached to both for 2 steps."""
    models = []
    for i, seed in enumerate((5, 6)):
        models.append(tmp_path / f"served{i}")
        build_tiny_causal_lm("llama", SIZE, seed=seed).save_pretrained(models[-1])
    logs = [tmp_path / f"serve-rollout{i}.log" for i in range(2)]
    started = _start_serve_rollouts(list(zip(models, logs, strict=True)), rollout_python)
    (_, url_a), (_, url_b) = started
    try:
        actor = CausalLMActor(
            build_tiny_causal_lm("llama", SIZE, seed=1),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(1,)),
            init_policy=False,
        )
        prompts = torch.randint(3, SIZE.vocab_size, (6, 7), generator=torch.Generator().manual_seed(0))
        lengths = torch.tensor([4, 7, 2, 6, 5, 3])
        sampled = RolloutRequest(prompts, lengths, actor.sampling, row_seeds(0, 6))
        greedy = RolloutRequest(
            prompts,
            lengths,
            SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(1,)),
            row_seeds(0, 6),
        )
        with VLLMRolloutEngine(actor, VLLMConfig(url=f"{url_a},{url_b}")) as engine:
            both = engine.generate(sampled)  # the first rollout pushes into both engines
            assert all(_http(u + "/info")[1]["lease"] is not None for u in (url_a, url_b))
            out = engine.generate(greedy)
            assert torch.equal(out.tokens, HFRolloutEngine(actor).generate(greedy).tokens)
            for gen in (both, out):
                mine, mask = _trainer_logprobs(actor, gen)
                assert gen.logprobs is not None
                # rows 0-2 came from A, 3-5 from B: each engine holds the actor's weights
                assert torch.allclose(gen.logprobs[mask], mine[mask], atol=LOGPROB_ATOL, rtol=0)
        with VLLMRolloutEngine(actor, VLLMConfig(url=url_b)) as engine:
            alone = engine.generate(sampled)
        assert torch.equal(alone.tokens, both.tokens)

        rows = _attached_ppo(tmp_path, f"{url_a},{url_b}", rollout_python)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["timing/weight_sync_s"] > 0 and r["rollout/engine_logprob_diff_max"] < LOGPROB_ATOL, r
        assert all(_http(u + "/info")[1]["lease"] is None for u in (url_a, url_b))
    finally:
        for proc, _ in started:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in started:
            try:
                assert proc.wait(timeout=60) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    for proc, _ in started:
        assert engine_processes(proc.pid) == []
