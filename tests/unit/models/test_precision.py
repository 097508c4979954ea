"""Precision: resolving the setting, autocast where it is promised, fp16 loss scaling, saved dtypes."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.models.precision import (
    Precision,
    check_precision,
    check_save_dtype,
    resolve_save_dtype,
    save_pretrained_as,
    stored_dtype,
)

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- resolution
def test_auto_is_fp32_on_cpu_with_no_autocast_and_no_loss_scaling():
    p = Precision.resolve("auto", CPU)
    assert p == Precision("fp32", "cpu") and not p.mixed
    assert p.compute_dtype == p.inference_dtype == torch.float32
    with p.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert not p.grad_scaler().is_enabled()


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, "bf16-mixed"), (False, "fp32")])
def test_auto_on_cuda_is_bf16_mixed_where_the_gpu_has_bf16(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
    p = Precision.resolve("auto", torch.device("cuda", 1))
    assert p == Precision(expected, "cuda")  # type: ignore[arg-type]


def test_explicit_settings_resolve_as_named():
    assert Precision.resolve("fp32", CPU).compute_dtype == torch.float32
    assert Precision.resolve("bf16-mixed", CPU).compute_dtype == torch.bfloat16
    fp16 = Precision.resolve("fp16-mixed", CPU)
    assert fp16.compute_dtype == fp16.inference_dtype == torch.float16
    assert fp16.grad_scaler().is_enabled()
    assert not Precision.resolve("bf16-mixed", CPU).grad_scaler().is_enabled()  # bf16 needs no scaling


def test_bad_settings_name_the_key_and_the_choices():
    choices = "auto, fp32, bf16-mixed, fp16-mixed"
    with pytest.raises(ValueError, match=rf"model\.precision must be one of {choices}"):
        check_precision("bf16", "model.precision")
    with pytest.raises(ValueError, match=r"exp\.save_dtype must be one of auto, fp32, bf16, fp16"):
        check_save_dtype("bfloat16", "exp.save_dtype")


# ---------------------------------------------------------------------------- autocast in forwards
def _linear_output_dtypes(model: torch.nn.Module) -> tuple[list[torch.dtype], list[object]]:
    seen: list[torch.dtype] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    return seen, hooks


@pytest.mark.parametrize(("name", "compute"), [("fp32", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_actor_scores_trains_and_generates_under_the_precisions_autocast(tiny, name, compute):
    model = tiny.causal_lm("llama")
    actor = CausalLMActor(
        model, sampling=SamplingParams(max_new_tokens=3), precision=Precision.resolve(name, CPU)
    )
    tokens = torch.randint(4, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    seen, hooks = _linear_output_dtypes(model)
    try:
        logprobs = actor.get_inference_log_probs(tokens)
        init_logprobs = actor.get_init_policy_logprobs(tokens)
        trained, _ = actor.training_logprobs(tokens, None, None)
        loss = -(trained * torch.ones(2, 6)).mean()  # any loss of the training forward
        loss.backward()
        out = actor.infer({"text": tokens[:, :3], "length": torch.tensor([3, 2])})
    finally:
        for h in hooks:
            h.remove()
    assert seen and set(seen) == {compute}  # every matmul of the policy ran in the compute dtype
    assert logprobs.dtype == torch.float32 and out["response_tokens"].shape[0] == 2
    # the initial policy is a float32 copy under the same autocast: at step 0 it agrees bit for bit
    assert torch.equal(logprobs, init_logprobs)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in actor.parameters())


def test_the_scalar_head_stays_float32_inside_autocast(tiny):
    model = tiny.reward_model()
    hidden = torch.randn(3, model.head.weight.shape[1])
    exact = model.apply_head(hidden)
    with Precision.resolve("bf16-mixed", CPU).autocast():
        mixed = model.apply_head(hidden)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, exact)


# ---------------------------------------------------------------------------- fp16 loss scaling
def test_fp16_loss_scaler_skips_a_step_whose_gradients_overflow_and_lowers_the_scale():
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    scaler = Precision.resolve("fp16-mixed", CPU).grad_scaler()
    before = [p.detach().clone() for p in layer.parameters()]
    scale = scaler.get_scale()
    x = torch.full((2, 4), 1e38)  # the scaled loss overflows float32
    with Precision.resolve("fp16-mixed", CPU).autocast():
        loss = layer(x).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True))
    assert scaler.get_scale() == scale / 2
    optimizer.zero_grad()
    with Precision.resolve("fp16-mixed", CPU).autocast():
        loss = layer(torch.ones(2, 4)).float().mean() / 100  # scaled gradients fit in float16
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not all(torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True))


# ---------------------------------------------------------------------------- saved dtypes
def test_save_pretrained_as_writes_the_dtype_and_leaves_the_live_model_alone(tiny, tmp_path):
    model = tiny.causal_lm("gpt2")  # ties lm_head to the token embedding
    masters = {k: v.clone() for k, v in model.state_dict().items()}
    save_pretrained_as(model, tmp_path, torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    assert not any("lm_head" in k for k in stored)  # still tied: stored once
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored_dtype(tmp_path) == torch.bfloat16
    assert all(torch.equal(v, masters[k]) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.dtype == torch.bfloat16  # loaders that take the stored dtype get bf16
    assert torch.equal(loaded.lm_head.weight, masters["transformer.wte.weight"].to(torch.bfloat16))


def test_save_pretrained_as_none_or_the_same_dtype_is_a_plain_save(tiny, tmp_path):
    model = tiny.causal_lm("llama")
    save_pretrained_as(model, tmp_path / "none")
    save_pretrained_as(model, tmp_path / "fp32", torch.float32)
    for d in ("none", "fp32"):
        assert stored_dtype(tmp_path / d) == torch.float32
        assert (tmp_path / d / "model.safetensors").read_bytes() == (
            tmp_path / "none" / "model.safetensors"
        ).read_bytes()


def test_save_dtype_auto_is_the_dtype_the_source_was_stored_in(tmp_path):
    configs = [("new", "dtype", "bfloat16"), ("old", "torch_dtype", "float16"), ("bare", "x", 1)]
    for name, key, value in configs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({key: value}))
    assert resolve_save_dtype("auto", tmp_path / "new") == torch.bfloat16
    assert resolve_save_dtype("auto", tmp_path / "old") == torch.float16
    assert resolve_save_dtype("auto", tmp_path / "bare") == torch.float32  # unstated: float32
    assert resolve_save_dtype("auto", None) == torch.float32  # a tiny built-in model
    assert resolve_save_dtype("fp32", tmp_path / "new") == torch.float32
    assert resolve_save_dtype("bf16", None) == torch.bfloat16
