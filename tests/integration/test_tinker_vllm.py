"""`openaligner serve-tinker rollout.engine=vllm` driven by the real ``tinker`` SDK (markers
``heavy``, ``vllm``, ``tinker``: skipped, naming ``make rollout-setup`` or ``make tinker-setup``,
without their virtualenvs): one server start, one tiny Llama (head size 32, which vLLM's CPU
attention serves).

Its greedy samples are the ``hf`` engine's on the same weights (computed here in-process from
the checkpoints the server wrote): before training, after forward_backward + optim_step +
save_weights_for_sampler (the engine was pushed the new weights), and from the first sampler
again after training (a sampler names a weight snapshot: the old one's are pushed back). Seeded
samples repeat; prompt log-probs are the model's. The server's SIGTERM ends its engine.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from test_tinker_sdk import TinkerServer, client, sdk  # noqa: F401 (the SDK venv fixture)
from test_vllm_engine import engine_processes, rollout_python  # noqa: F401 (the rollout venv fixture)
from transformers import AutoModelForCausalLM

from openaligner.models.actor import CausalLMActor
from openaligner.models.tokenizers import load_tokenizer
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.servers.tinker.sampling import TinkerSampling, sample
from openaligner.trainer.tinker_model import TinkerModel, read_checkpoint_lora

# measured: 524 s on the shared 2-core machine at load average 6-8 (vLLM's start is most of it)
pytestmark = [pytest.mark.heavy, pytest.mark.vllm, pytest.mark.tinker, pytest.mark.timeout(1500)]

LOGPROB_ATOL = 1e-5  # both sides' log-probs are the served model's own forward (float32)


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_causal_lm(tmp_path_factory.mktemp("tiny-llama-h32"), "llama", num_heads=2)


def hf_greedy(
    model_dir: Path, checkpoint: Path, prompt: list[int], max_tokens: int
) -> tuple[list, list, list]:
    """The hf engine's greedy sample and prompt log-probs on the adapters saved at ``checkpoint``."""
    lora, _ = read_checkpoint_lora(checkpoint)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trainer = TinkerModel(base, lora)
    trainer.load(checkpoint, optimizer=False)
    tok = load_tokenizer(model_dir)
    params = TinkerSampling(max_tokens, 0.0, 0, 1.0, 0, (), ())
    engine = HFRolloutEngine(CausalLMActor(trainer.model, tok, init_policy=False))
    seqs, plp = sample(
        engine, trainer.model, torch.tensor(prompt), 1, params, tokenizer=tok, prompt_logprobs=True
    )
    assert plp is not None
    return seqs[0].tokens.tolist(), seqs[0].logprobs.tolist(), plp[1:].tolist()


def test_the_vllm_engine_samples_the_saved_weights_as_hf_does(sdk, rollout_python, model_dir, tmp_path):  # noqa: F811
    checkpoints = tmp_path / "checkpoints"
    served = TinkerServer(checkpoints, "rollout.engine=vllm", f"rollout.vllm.python={rollout_python}")
    try:
        url = served.wait_ready(timeout_s=180)
        assert "sampling engine vllm" in served.output
        out = client(sdk, "engine", url, str(model_dir), timeout_s=1200)
        assert "vllm rollout engine: serving on" in served.output  # sampled by vLLM, not the hf loop
        os.kill(served.proc.pid, signal.SIGTERM)
        assert served.proc.wait(timeout=120) == 0, served.output[-3000:]
        assert engine_processes(served.proc.pid) == []  # its close ended the engine's process group
    finally:
        served.kill()

    def saved(path: str) -> Path:
        model_id, kind, name = path.removeprefix("tinker://").split("/")
        return checkpoints / model_id / kind / name

    prompt = out["prompt"]
    before_tokens, before_lps, _ = hf_greedy(model_dir, saved(out["before_path"]), prompt, 8)
    after_tokens, after_lps, after_prompt_lps = hf_greedy(model_dir, saved(out["after_path"]), prompt, 8)
    (first,) = out["first"]
    assert first["tokens"] == before_tokens
    assert first["logprobs"] == pytest.approx(before_lps, abs=LOGPROB_ATOL)
    assert after_tokens != before_tokens  # training changed the greedy continuation
    for trained in out["trained"]:  # num_samples=2 from the saved path, after the push
        assert trained["tokens"] == after_tokens and trained["stop_reason"] == "length"
        assert trained["logprobs"] == pytest.approx(after_lps, abs=LOGPROB_ATOL)
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1:] == pytest.approx(after_prompt_lps, abs=LOGPROB_ATOL)
    assert out["old_again"] == out["first"]  # the first sampler's snapshot, pushed back
    one, two = out["draws"]
    assert one == two and len(one) == 3  # seeded: the same samples again
    assert all(len(s["tokens"]) == len(s["logprobs"]) == 6 or s["stop_reason"] == "stop" for s in one)
