"""models/sharding.py: the decoder layers of every architecture, the `parallel` section's checks,
activation checkpointing, and (2 gloo ranks) what shards hold and that every way of holding the
weights trains alike."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openaligner.models.builders import TINY_ARCHS, TinySize, build_tiny_causal_lm, build_tiny_critic
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.models.sharding import (
    ActorParallelConfig,
    ParallelConfig,
    ShardingError,
    decoder_layers,
    is_sharded,
    meta_copy,
    shard,
    training_state_bytes,
)

WORKER = Path(__file__).with_name("sharding_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_architecture_has_one_unit_per_decoder_layer(arch):
    model = build_tiny_causal_lm(arch, TinySize(num_layers=3))
    layers = decoder_layers(model)
    assert len(layers) == 3
    assert len({type(layer) for layer in layers}) == 1
    assert "Layer" in type(layers[0]).__name__ or "Block" in type(layers[0]).__name__


def test_a_critic_and_a_lora_model_have_their_backbones_layers():
    assert len(decoder_layers(build_tiny_critic("llama", TinySize(num_layers=2)))) == 2
    lora = add_lora(build_tiny_causal_lm("llama", TinySize(num_layers=2)), LoraConfig(r=2))
    assert len(decoder_layers(lora)) == 2


def test_settings_that_cannot_work_are_refused_naming_the_key():
    with pytest.raises(ShardingError, match=r"parallel\.strategy='zero3' is not one of ddp, fsdp"):
        ParallelConfig(strategy="zero3")
    with pytest.raises(ShardingError, match=r"parallel\.offload=true .* needs parallel\.strategy=fsdp"):
        ParallelConfig(offload=True)
    with pytest.raises(ShardingError, match="fp16 loss scaling checks overflow per shard; use bf16-mixed"):
        ParallelConfig(strategy="fsdp").check_precision("fp16-mixed")
    with pytest.raises(
        ShardingError, match=r"parallel\.offload_init_policy=true .* needs parallel\.strategy"
    ):
        ActorParallelConfig(offload_init_policy=True)
    with pytest.raises(
        ShardingError, match=r"parallel\.generation='sampled' is not one of gathered, layerwise"
    ):
        ActorParallelConfig(strategy="fsdp", generation="sampled")
    ParallelConfig(strategy="fsdp").check_precision("bf16-mixed")
    ParallelConfig(strategy="ddp").check_precision("fp16-mixed")


def test_a_model_without_named_layers_cannot_be_checkpointed_or_sharded():
    with pytest.raises(ShardingError, match="names no decoder-layer class in _no_split_modules"):
        shard(torch.nn.Linear(2, 2), ParallelConfig(activation_checkpointing=True))


def test_one_process_is_never_sharded():
    model = shard(build_tiny_causal_lm("llama"), ParallelConfig(strategy="fsdp"))
    assert not is_sharded(model)


def test_activation_checkpointing_gives_the_same_gradients_and_keeps_the_names():
    tokens = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, runs = [], []
    for on in (False, True):
        model = build_tiny_causal_lm("llama", seed=0)
        calls = [0]
        for layer in decoder_layers(model):
            forward = layer.forward

            def counted(*args, _forward=forward, calls=calls, **kwargs):
                calls[0] += 1
                return _forward(*args, **kwargs)

            layer.forward = counted
        model = shard(model, ParallelConfig(activation_checkpointing=on))
        model.eval()  # the checkpointing is ours, not Hugging Face's: it holds in eval mode too
        model(input_ids=tokens, labels=tokens).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        with torch.no_grad():  # a forward without gradient runs each layer once
            model(input_ids=tokens)
        runs.append(calls[0])
    assert runs == [2 * 2, 2 * 2 + 2]  # 2 layers: checkpointed, each runs again in the backward
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


def test_training_state_bytes_counts_params_grads_and_adam_state_once():
    p = torch.nn.Parameter(torch.zeros(10))
    tied = [p, p]  # a tied weight listed twice is one storage
    p.grad = torch.ones(10)
    opt = torch.optim.AdamW(tied[:1], lr=0.1)
    opt.step()
    got = training_state_bytes(tied, opt)
    assert got == {"params": 40, "grads": 40, "optimizer": 80 + 4, "total": 164}  # exp_avg, exp_avg_sq, step


@pytest.mark.slow
def test_two_ranks_shards_hold_about_half_every_way_trains_alike_and_rank0_alone_reads(tmp_path):
    """Per rank, parameters + gradients + AdamW state of shards are at most 0.55× those of a
    replica (exactly half plus each tensor's padding to a multiple of 2 rows). Shards, shards in
    CPU memory and shards with activation checkpointing compute the same two steps as replicas:
    the same float32 weights are gathered and the same gradients summed, so losses and weights
    agree to the rounding of the gradient norm (clipping at 1.0 is active here, so the norm's
    summation order over shards reaches the weights). Losses and gradient norms: rel 1e-5, i.e.
    ≤ 160 float32 ulps (the third step's loss runs on weights AdamW moved apart by up to the
    tolerance below; measured ≤ 3.5 ulps, a fifth of the rel 1e-6 used before). Weights are
    compared with abs 1e-4: AdamW divides each coordinate's step by its own gradient scale, so a
    coordinate whose gradient is near zero can turn a rounding-level difference into a visible one
    (bounded by lr = 1e-3 per step)."""
    prefix = tmp_path / "out"
    subprocess.run([*TORCHRUN, str(WORKER), str(prefix)], check=True, timeout=300)
    ranks = [json.loads(Path(f"{prefix}.rank{r}").read_text()) for r in range(2)]
    for r in ranks:
        replica, sharded = r["ddp"]["memory"], r["fsdp"]["memory"]
        for part in ("params", "grads", "optimizer", "total"):
            assert sharded[part] <= 0.55 * replica[part], part
        assert r["fsdp_offload"]["memory"]["total"] == sharded["total"]  # the same shards, in CPU memory
    # rank 0 alone reads the saved models; rank 1 builds skeletons and gets the same weights
    assert [r["loaded_from_rank0"]["skeleton"] for r in ranks] == [False, True]
    assert [r["loaded_from_rank0"]["lm_on_meta"] for r in ranks] == [False, True]
    for r in ranks:  # (the sharded reward model's forward rounds its last digit differently, on rank 0 too)
        assert r["loaded_from_rank0"]["lm_equal"] and r["loaded_from_rank0"]["rm_diff"] < 1e-6
    # the initial policy: no rank held a whole second copy of the weights, and it is the same model
    for r in ranks:
        assert r["loaded_from_rank0"]["init_policy_on_meta_when_sharded"]
        assert r["loaded_from_rank0"]["init_equal"]
    rank0 = ranks[0]
    ddp = rank0["ddp"]
    assert ddp["grad_norms"][0] > 1.0  # clipping acts
    for way in ("fsdp", "fsdp_offload", "fsdp_checkpointing"):
        got = rank0[way]
        assert got["losses"] == pytest.approx(ddp["losses"], rel=1e-5), way
        assert got["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-5), way
        assert got["weights"].keys() == ddp["weights"].keys()
        for name, total in ddp["weights"].items():
            assert got["weights"][name] == pytest.approx(total, rel=1e-5, abs=1e-4), (way, name)


_FREE_AND_MEASURE = """
import sys, torch
from openaligner.models.sharding import return_large_frees_to_os

def resident_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "policy":
    assert return_large_frees_to_os()
torch.ones(1024).add_(1).sum()  # torch's lazy start-up (thread pools, kernels) before measuring
before = resident_mib()
for _ in range(3):  # what a sharded rank does per layer: gather 16 MiB, compute, free it
    layer = torch.ones(4 * 2**20)
    del layer
print(resident_mib() - before)
"""


def _resident_after_frees(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _FREE_AND_MEASURE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_a_sharded_process_returns_freed_layers_to_the_os():
    """The mechanism behind sharded ranks' resident memory: glibc's dynamic mmap threshold keeps a
    freed layer-sized block resident in the heap; with the policy a sharded process runs under
    (:func:`return_large_frees_to_os`, set by ``shard``) the freed blocks go back to the OS."""
    if _resident_after_frees("default") < 12:  # the C library already returns them: nothing to show
        pytest.skip("this C library returns freed 16 MiB blocks by default")
    # Freed blocks are 16 MiB: a C library keeping even one resident stays at 16 MiB or more;
    # under the policy what remains is other allocations' noise (measured 0.04 MiB after the
    # warm-up, 5.4 MiB without it, when torch's lazy start-up fell inside the measurement).
    assert _resident_after_frees("policy") < 8


def test_sharding_sets_the_allocator_policy(monkeypatch):
    calls = []
    monkeypatch.setattr("openaligner.models.sharding.return_large_frees_to_os", lambda: calls.append(1))
    monkeypatch.setattr(ParallelConfig, "sharded", property(lambda self: self.strategy == "fsdp"))
    monkeypatch.setattr("openaligner.models.sharding.fully_shard", lambda module, **kwargs: module)
    monkeypatch.setattr("openaligner.models.sharding._fsdp_modules", lambda model: [])
    shard(build_tiny_causal_lm("llama"), ParallelConfig(strategy="ddp"))
    assert calls == []
    shard(build_tiny_causal_lm("llama"), ParallelConfig(strategy="fsdp"))
    assert calls == [1]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_meta_copy_holds_no_weights_and_keeps_ties_flags_and_buffers(arch):
    model = build_tiny_causal_lm(arch, seed=0)
    model.get_input_embeddings().weight.requires_grad_(False)
    copied = meta_copy(model)
    assert all(p.is_meta for p in copied.parameters())
    assert [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in copied.named_parameters(remove_duplicate=False)
    ] == [(n, p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (copied.get_output_embeddings().weight is copied.get_input_embeddings().weight) == tied
    buffers = dict(model.named_buffers())
    for name, buffer in copied.named_buffers():  # real copies (rotary frequencies), not shared
        assert not buffer.is_meta and torch.equal(buffer, buffers[name])
        assert buffer.data_ptr() != buffers[name].data_ptr()
    assert not any(p.is_meta for p in model.parameters())  # the original is untouched
