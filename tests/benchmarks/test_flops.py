"""benchmarks/flops.py: the matmul parameters its FLOP count uses are the model's own."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from transformers import GPT2Config, GPT2LMHeadModel, Qwen2ForCausalLM

from bench_rollout_engine import qwen2_config
from flops import gpt2_shape, llama_shape


def _linear_weights(model: nn.Module) -> int:
    """Parameters of every matrix multiply: nn.Linear weights (and GPT-2's Conv1D), the head counted
    once even when it is tied to the embedding."""
    return sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    )


def test_the_qwen2_matmul_count_is_the_models_linear_weights():
    # Qwen2.5-0.5B's shape: 14 query and 2 key/value heads, a gated MLP, a tied head
    config = qwen2_config("0.5b", 512)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    shape = llama_shape(config)
    assert shape.matmul_params == _linear_weights(model) == 493_961_216
    # 6·N + 12·L·d·S per token
    assert shape.train_flops_per_token(288) == 6 * 493_961_216 + 12 * 24 * 896 * 288


def test_the_gpt2_count_is_unchanged():
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=256)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    assert gpt2_shape(config).matmul_params == _linear_weights(model)


def test_the_engine_benchmark_counts_generated_tokens_only():
    """bench_rollout_engine's tokens/s divides the *new* tokens (not prompt + response) by the time."""
    from bench_rollout_engine import _request, _timed
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.rollout.hf_engine import HFRolloutEngine

    actor = CausalLMActor(build_tiny_causal_lm("qwen2", TinySize(vocab_size=64)), init_policy=False)
    request = _request(prompts=2, samples=2, prompt_len=5, new_tokens=3, vocab=64, seed=0)
    _, tokens = _timed(HFRolloutEngine(actor), request, torch.device("cpu"))
    assert tokens == 4 * 3
