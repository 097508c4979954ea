"""Checkpoints and exports of a model sharded over 2 ranks (one torchrun of sharded_files_worker.py):
the checkpoint every rank wrote reloads exactly on 2 ranks and on 1 process, the critic's too; the
export is a plain Hugging Face directory in several files that loads with ``from_pretrained`` and
gives the trained logits; LoRA writes its adapter and merged model; a checkpoint of a model that
was not sharded is refused with the fix.

``openaligner export-critic`` writes the sharded critic's checkpoint (either key naming) as a
Hugging Face directory with its values.

Tolerances: none where the same float32 values travel (checkpoints, the float32 export, the
bfloat16 export against the gathered weights cast to bfloat16): DCP and safetensors copy bytes.
The merged LoRA model differs from the adapted one by the rounding of ``W + s·BA`` (atol 1e-5).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from openaligner.cli.main import main
from openaligner.io.checkpoint import CheckpointManager, verify_checkpoint
from openaligner.models.builders import TinySize, build_tiny_causal_lm, build_tiny_critic
from openaligner.models.critic import CriticModel
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.models.weights import load_weights_into
from openaligner.trainer.checkpoint_files import TrainingFiles
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

WORKER = Path(__file__).with_name("sharded_files_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
FILES = TrainingFiles(model_dir="model", state_file="state.json")
SIZE = TinySize(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2)
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 31, 0, 6]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    subprocess.run([*TORCHRUN, str(WORKER), str(out)], check=True, timeout=300)
    return out, torch.load(out / "rank0.pt", weights_only=False)


def with_weights(state, seed=1):
    model = build_tiny_causal_lm("gpt2", SIZE, seed=seed)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.slow
def test_every_rank_writes_its_shards_and_one_process_reads_them_back_exactly(run):
    out, report = run
    step = out / "checkpoints" / "step_1"
    assert report["published"] == str(step) and CheckpointManager(out / "checkpoints").latest() == step
    assert verify_checkpoint(step) is None  # rank 1's file is in the manifest rank 0 sealed
    assert {p.name for p in step.iterdir()} == {
        "model.dcp",
        "scheduler.pt",
        "rng.pt",
        "state.json",
        "manifest.json",
    }
    assert {p.name for p in (step / "model.dcp").iterdir()} == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "config.json",  # the model's, for an export
    }
    assert report["reloaded"]  # 2 ranks read it back into a fresh sharded model
    # 1 process (no process group, nothing sharded): DCP puts the two ranks' shards together
    model = build_tiny_causal_lm("gpt2", SIZE, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    assert FILES.read(step, model, opt, scheduler, torch.device("cpu")) == {"step": 1}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, report["weights"][name]), name
    saved, loaded = report["optimizer"], get_optimizer_state_dict(model, opt)
    assert saved["state"].keys() == loaded["state"].keys()
    for name, moments in saved["state"].items():
        for key, value in moments.items():
            assert torch.equal(loaded["state"][name][key], value), (name, key)
    assert scheduler.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert len(torch.load(step / "rng.pt", weights_only=False)) == 2  # every rank's RNG states


@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_publishes_nothing(run):
    out, report = run
    for message in report["failures"]:  # rank 0's and rank 1's
        assert "checkpoint write failed on rank(s) [1]" in message
        assert "rank 1: OSError: No space left on device (simulated)" in message
    assert CheckpointManager(out / "checkpoints").latest() == out / "checkpoints" / "step_1"
    assert not (out / "checkpoints" / "step_2").exists()


@pytest.mark.slow
def test_the_export_is_a_hugging_face_directory_in_several_files_with_the_trained_logits(run):
    out, report = run
    export = out / "export_fp32"
    files = sorted(p.name for p in export.glob("model-*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    # the tied head is written once, as a one-process save_pretrained writes it (it was a 2nd copy)
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    loaded = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, with_weights(report["weights"])(TOKENS).logits)
    # the save dtype: bfloat16 files, config.json says so, the gathered weights rounded once
    bf16 = out / "export_bf16"
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    stored = {}
    for f in bf16.glob("model-*.safetensors"):
        stored |= load_file(f)
    assert stored and all(t.dtype == torch.bfloat16 for t in stored.values())
    for name, tensor in stored.items():
        assert torch.equal(tensor, report["weights"][name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_a_sharded_lora_model_checkpoints_and_exports_its_adapter_and_its_merged_model(run):
    out, report = run
    lora = add_lora(build_tiny_causal_lm("gpt2", SIZE, seed=0), LoraConfig(r=4)).eval()
    load_weights_into(lora, out / "adapter")
    assert (out / "adapter" / "tokenizer_config.json").exists() is False  # no tokenizer attached
    for name, tensor in lora.state_dict().items():
        assert torch.equal(tensor, report["lora"][name]), name
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in report["lora"].items())  # it trained
    # its checkpoint holds the trained weights only (adapters), which 1 process reads back
    step = out / "lora_checkpoints" / "step_1"
    fresh = add_lora(build_tiny_causal_lm("gpt2", SIZE, seed=0), LoraConfig(r=4))
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    lora_files = TrainingFiles(model_dir="adapter", state_file="state.json")
    assert lora_files.read(step, fresh, opt, None, torch.device("cpu")) == {"step": 1}
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, report["lora"][name]), name
    # ... and a model without LoRA cannot: named, with the fix
    plain = build_tiny_causal_lm("gpt2", SIZE, seed=0)
    with pytest.raises(ValueError, match=r"adapter\.dcp into the GPT2LMHeadModel.*other lora settings"):
        lora_files.read(step, plain, torch.optim.AdamW(plain.parameters()), None, torch.device("cpu"))
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS).logits, lora(TOKENS).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_critic_checkpoint_of_every_rank_resumes_sharded_and_on_one_process_and_it_exports(run):
    out, report = run
    assert report["critic_restored"]  # 2 ranks, sharded, through CriticTrainer.resume
    step = out / "critic" / "step_1"
    assert (step / "critic.dcp").is_dir() and not (step / "critic").exists()
    critic = build_tiny_critic("gpt2", SIZE, seed=1)
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=2),
        critic,
        torch.optim.AdamW(critic.parameters(), lr=0.05),
        checkpoints=CheckpointManager(out / "critic"),
    )
    trainer.resume()
    assert trainer.step == 1
    for name, tensor in critic.state_dict().items():
        assert torch.equal(tensor, report["critic"][name]), name
    exported = CriticModel.from_pretrained(out / "critic_export")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, report["critic"][name]), name


def stored_model_keys(directory: Path) -> set[str]:
    """The model's keys in a sharded checkpoint's DCP directory (without DCP's ``model.``)."""
    stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in stored if k.startswith("model.")}


@pytest.mark.slow
def test_the_critic_checkpoint_is_keyed_by_hugging_face_names_as_the_actors_is(run):
    out, _ = run
    critic = stored_model_keys(out / "critic" / "step_1" / "critic.dcp")
    actor = stored_model_keys(out / "checkpoints" / "step_1" / "model.dcp")
    assert not any("hf_model" in k for k in critic)
    # the same backbone under the same names; the heads are each model's own (score / tied lm_head)
    assert critic - {"score.weight"} == {k for k in actor if k.startswith("transformer.")}
    assert "score.weight" in critic
    # the Hugging Face config comes with the shards (what an export needs besides the weights)
    config = AutoConfig.from_pretrained(out / "critic" / "step_1" / "critic.dcp")
    assert config.num_labels == 1 and config.n_layer == SIZE.num_layers


@pytest.mark.slow
def test_a_critic_checkpoint_with_the_old_hf_model_prefix_still_resumes(run):
    out, report = run
    assert all(
        k.startswith("hf_model.") for k in stored_model_keys(out / "critic_old" / "step_1" / "critic.dcp")
    )
    critic = build_tiny_critic("gpt2", SIZE, seed=1)
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=2),
        critic,
        torch.optim.AdamW(critic.parameters(), lr=0.05),
        checkpoints=CheckpointManager(out / "critic_old"),
    )
    trainer.resume()
    assert trainer.step == 1
    for name, tensor in critic.state_dict().items():
        assert torch.equal(tensor, report["critic"][name]), name
    assert trainer.optimizer.state  # AdamW's moments came back too


@pytest.mark.slow
def test_a_checkpoint_of_a_model_that_was_not_sharded_is_refused_on_every_rank_with_the_fix(run):
    _, report = run
    for message in report["refusals"]:
        assert message is not None
        assert "parallel.strategy=ddp" in message and "parallel.strategy=fsdp" in message
        assert "model.dcp/" in message and "as the model path" in message


def critic_values(hf_model, tokens=TOKENS):
    with torch.no_grad():
        return CriticModel(hf_model).eval()(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("written", ["critic", "critic_old"])
def test_export_critic_writes_the_sharded_critic_as_a_hugging_face_directory(run, tmp_path, written):
    """``openaligner export-critic`` on the checkpoint every rank wrote (and on one keyed the old way,
    which carries no config.json: the model directory supplies it): the directory loads with
    ``AutoModelForSequenceClassification`` and gives the trained critic's values, exactly."""
    out, report = run
    trained = build_tiny_critic("gpt2", SIZE, seed=1)
    trained.load_state_dict(report["critic"])
    args = ["export-critic", str(out / written / "step_1"), str(tmp_path / "hf")]
    if written == "critic_old":
        assert main(args) == 2  # no config.json with those shards: refused, naming the option
        args += ["--config-dir", str(out / "critic_export")]
    assert main(args) == 0
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(critic_values(loaded), critic_values(trained.hf_model))
    with torch.no_grad():  # Hugging Face's own read-out: the head at the last token
        last = loaded(TOKENS[:1]).logits[0, 0]
    # against the trained critic on the same one-row batch: a two-row batch may take another
    # matmul path on some CPUs and differ in the last bit (0.6915 vs 0.6915 on one CI machine)
    assert torch.equal(last, critic_values(trained.hf_model, TOKENS[:1])[0, -1])
