"""The real Gemma 3 270M through the vllm rollout engine (markers ``realmodel``, ``vllm``,
``heavy``): its head size (256) is one vLLM's CPU attention serves. The actor is loaded from the
converted directory named by ``OPENALIGNER_GEMMA_DIR`` (docs/real-model.md) the way train-ppo loads
it (float32 master weights), with LoRA adapters on ``q_proj``/``v_proj`` as ``lora.r`` puts them.

Greedy continuations of the engine are the ``hf`` engine's, and the engine's log-probs of them the
trainer's, (1) at the start, (2) after the adapters change (``lora_B`` made non-zero: the adapters
stop being the identity) and a push, and (3) after every base weight is perturbed and a push; each
change changes the continuations, so a stale engine would fail.

Tolerance: both sides float32; vLLM's CPU kernels sum in another order than PyTorch's over a
640-wide, 18-layer model with a 262k vocabulary: measured max |Δ log p| 4e-5 to 5e-5 (mean ~1.5e-5),
so LOGPROB_ATOL leaves a 10x margin.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from openaligner.algorithms import response_mask
from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.models.source import ModelSourceConfig, load_causal_lm
from openaligner.rollout.engine import RolloutEngine, RolloutRequest, row_seeds
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.rollout.vllm_config import VLLMConfig
from openaligner.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = [pytest.mark.realmodel, pytest.mark.vllm, pytest.mark.heavy, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GEMMA_DIR = os.environ.get("OPENALIGNER_GEMMA_DIR", "")
LOGPROB_ATOL = 5e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    path = Path(GEMMA_DIR) if GEMMA_DIR else None
    if path is None or not (path / "config.json").is_file():
        pytest.skip(
            "needs a converted Gemma 3 270M directory in OPENALIGNER_GEMMA_DIR (make real-model; "
            "docs/real-model.md): download + conversion exceed CI's budget, so this runs on request"
        )
    return path


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


def _request(actor: CausalLMActor) -> RolloutRequest:
    """[4, P] right-padded prompts (each starting with BOS) and their lengths."""
    assert actor.tokenizer is not None
    ids = [actor.tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, ids))
    prompts = torch.zeros(len(ids), width, dtype=torch.long)
    for row, seq in enumerate(ids):
        prompts[row, : len(seq)] = torch.tensor(seq)
    lengths = torch.tensor([len(s) for s in ids])
    return RolloutRequest(prompts, lengths, actor.sampling, row_seeds(0, len(ids)))


def _agree(engine: RolloutEngine, actor: CausalLMActor, request: RolloutRequest, what: str) -> torch.Tensor:
    """The engine's greedy tokens after asserting they are the hf engine's and its log-probs the
    trainer's; prints the largest |Δ log p| (recorded in docs/rollout-engine.md)."""
    out = engine.generate(request)
    reference = HFRolloutEngine(actor).generate(request)
    assert torch.equal(out.tokens, reference.tokens), what
    assert torch.equal(out.sequence_lengths, reference.sequence_lengths), what
    mine = actor.get_inference_log_probs(out.tokens, out.sequence_lengths, prompt_lengths=out.prompt_lengths)
    mask = response_mask(out.prompt_lengths, out.sequence_lengths, out.tokens.shape[1] - 1).bool()
    assert out.logprobs is not None
    diff = (out.logprobs[mask] - mine[mask]).abs()
    print(f"{what}: |Δ log p| mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.max() < LOGPROB_ATOL, what
    return out.tokens


def test_gemma_generates_through_the_engine_after_lora_and_full_updates(gemma_dir, rollout_python):
    peft = pytest.importorskip("peft")
    assert peft is not None
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model = load_causal_lm(ModelSourceConfig(path=str(gemma_dir)), 0, torch.device("cpu"))
    assert model.config.head_dim == 256
    model = add_lora(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    tokenizer = AutoTokenizer.from_pretrained(str(gemma_dir), local_files_only=True)
    actor = CausalLMActor(
        model, tokenizer, SamplingParams(greedy=True, max_new_tokens=8), init_policy=False, cache="dynamic"
    )
    request = _request(actor)
    config = VLLMConfig(
        python=rollout_python, max_model_len=128, start_timeout_s=1800, request_timeout_s=1800
    )
    with VLLMRolloutEngine(actor, config) as engine:
        first = _agree(engine, actor, request, "start")
        print(f"load + engine start + first rollout: {time.perf_counter() - t0:.0f} s")

        # a LoRA update: B made non-zero, so the adapters stop being the identity
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            lora_b = [p for n, p in actor.model.named_parameters() if "lora_B" in n]
            assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)  # peft starts B at zero
            for p in lora_b:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        t1 = time.perf_counter()
        engine.update_weights(actor, 1)
        after_lora = _agree(engine, actor, request, "after a LoRA update")
        print(
            f"push + rollout after the LoRA update: {time.perf_counter() - t1:.1f} s, {engine.pop_metrics()}"
        )
        assert not torch.equal(after_lora, first)

        # a full update: every base weight perturbed (the adapters kept)
        with torch.no_grad():
            for n, p in actor.model.named_parameters():
                if "lora_" not in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.float().std().clamp(min=1e-3))
        t2 = time.perf_counter()
        engine.update_weights(actor, 2)
        after_full = _agree(engine, actor, request, "after a full update")
        print(
            f"push + rollout after the full update: {time.perf_counter() - t2:.1f} s, {engine.pop_metrics()}"
        )
        assert not torch.equal(after_full, after_lora)
