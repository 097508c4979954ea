"""train-sft and train-rm under torchrun (gloo, CPU): two sharded ranks (fsdp) equal two replicas
(ddp) and one process on the same run, every rank runs the same forwards, two ranks resume
exactly from their checkpoints (replicated and sharded), and batch sizes that would give ranks
different micro-batch counts are refused before anything loads."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from openaligner import distributed as dp
from openaligner.cli.main import main
from openaligner.config import ConfigError, StartupError, load_config
from openaligner.trainer.sft import SFTConfig
from openaligner.trainer.supervised import even_split, rank_share

WORKER = Path(__file__).with_name("supervised_dp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def write_data(directory: Path) -> Path:
    """48 training and 5 validation records of each kind (5 = 3 validation micro-batches of 2)."""
    for name, n in (("", 48), ("_val", 5)):
        with (directory / f"sft{name}.jsonl").open("w") as f:
            for i in range(n):
                d = (i * 7 + len(name)) % 10
                f.write(json.dumps({"prompt": f"repeat {d}:", "response": f" {d}{d}{d}"[: 2 + i % 3]}) + "\n")
        with (directory / f"rm{name}.jsonl").open("w") as f:
            for i in range(n):
                chosen, rejected = ["yes", "yes!", "sure yes"][i % 3], ["no", "no.", "nope no"][(i + 1) % 3]
                f.write(
                    json.dumps({"prompt": f"q{i * 13 % 97}?", "chosen": chosen, "rejected": rejected}) + "\n"
                )
    return directory


def run_worker(
    tmp_path: Path, name: str, ranks: int, objective: str, *overrides: str, env: dict[str, str] | None = None
) -> dict:
    """One run; its metrics per step (rank 0's metrics.jsonl), final weights (the export, loaded
    as Hugging Face loads it) and every rank's forward counts."""
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        write_data(data)
    env = os.environ | {"OBJECTIVE": objective} | (env or {})
    launcher = TORCHRUN if ranks == 2 else [sys.executable]
    subprocess.run(
        [*launcher, str(WORKER), str(out), str(data), *overrides], check=True, timeout=300, env=env
    )
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {
        "metrics": metrics,
        "weights": exported_weights(out / "run", objective),
        "forwards": [json.loads((out / f"rank{r}.json").read_text())["forwards"] for r in range(ranks)],
    }


def exported_weights(directory: Path, objective: str) -> dict[str, torch.Tensor]:
    """The exported model's weights as Hugging Face loads them (a LoRA run's merged model)."""
    if (directory / "merged").is_dir():
        directory = directory / "merged"
    cls = AutoModelForCausalLM if objective == "sft" else AutoModelForSequenceClassification
    return cls.from_pretrained(directory, local_files_only=True).state_dict()


KEYS = {
    "sft": ("train/loss", "train/grad_norm", "val/loss"),
    "rm": (
        "train/loss",
        "train/accuracy",
        "train/rewards_chosen_mean",
        "train/grad_norm",
        "val/loss",
        "val/accuracy",
        "val/rewards_rejected_mean",
    ),
}


# The equivalence runs train with plain SGD and no clipping, so that a weight is its start minus
# lr × the sum of its gradients: what differs between runs is then only the rounding of those sums.
# AdamW would hide the defects this test exists for (its update g / (√v + ε) does not change when
# every gradient doubles) and would amplify the rounding noise of near-zero gradients into updates
# of up to lr (measured with AdamW here: 1.9e-6 apart on GPT-2's key biases, 43× relative, while
# summing instead of averaging two ranks' gradients moved the weights by only 5e-4). The AdamW path
# of the same runs is checked bitwise by the resume test below.
SGD = ("optim.lr=0.1", "trainer.gradient_clip_val=0")
# Weights after 3 SGD steps: |Δw| ≤ 3 steps × lr 0.1 × |δg| + one rounding of w (|w| < 4: 2.4e-7).
# |δg| is the rounding of a sum of ≤ 4 float32 micro-batch gradients, each |g| < 5 (the logged
# gradient norms bound every element): ≤ 4 × 2⁻²⁴ × 5 × 4 terms ≈ 4.8e-6, so |Δw| ≤ 1.7e-6 in the
# worst case. Measured: ≤ 1.7e-8 fsdp vs ddp, ≤ 6e-8 ddp vs one process. Real defects, measured on
# these runs: summing instead of averaging the ranks' gradients moves weights by 0.10 (GPT-2) and
# 0.19 (Llama), 5 orders of magnitude above ATOL; a rank training on the wrong rows changes the
# step-1 loss itself, which the metrics check catches.
ATOL = 2e-6


def sgd_run(tmp_path: Path, name: str, ranks: int, objective: str, *overrides: str, defect: str = "") -> dict:
    """:func:`run_worker` with plain SGD (``OPTIMIZER=sgd``, see supervised_dp_worker.py)."""
    env = {"OPTIMIZER": "sgd"} | ({"DEFECT": defect} if defect else {})
    return run_worker(tmp_path, name, ranks, objective, *SGD, *overrides, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("objective, arch", [("sft", "gpt2"), ("rm", "llama")])
def test_two_ranks_sharded_or_replicated_match_one_process(tmp_path, objective, arch):
    """3 steps of 8 examples (pairs) in micro-batches of 2, then validation of 5 in micro-batches
    of 2, on 1 process, 2 replicas and 2 sharded ranks: the same losses, gradient norms,
    validation metrics and exported weights.

    Tolerances. fsdp and ddp gather the same float32 weights, run the same forwards and sum the
    same gradients over the same two ranks; only the association differs (each backward's
    reduce-scatter sums per micro-batch, (a1+b1)+(a2+b2) instead of (a1+a2)+(b1+b2), and the
    gradient norm is a sum of squares over shards first). One process accumulates all 4
    micro-batches on one rank: another summation order. Metrics: rel 1e-5 (float32 ulps are 6e-8;
    measured ≤ 2e-7). Weights: :data:`ATOL`, derived above. The RM case also runs the replicas with
    a defect (gradients summed over ranks, not averaged) and shows the weight check fails on it.

    Micro-batch size: one process training each global batch in one micro-batch of 8 (1 × 8)
    matches the 2 ranks' 2 micro-batches of 2 each, with the same tolerances (one sum of 8 rows'
    gradients instead of 4 sums: fewer rounded additions than the bound above counts): the SFT
    NLL is a token mean, the RM loss a pair mean, over the whole global batch.
    """
    one = sgd_run(tmp_path, "one", 1, objective, f"model.tiny={arch}")
    whole = sgd_run(tmp_path, "whole", 1, objective, f"model.tiny={arch}", "trainer.micro_batch_size=8")
    ddp = sgd_run(tmp_path, "ddp", 2, objective, f"model.tiny={arch}", "parallel.strategy=ddp")
    fsdp = sgd_run(tmp_path, "fsdp", 2, objective, f"model.tiny={arch}", "parallel.strategy=fsdp")
    assert [m["step"] for m in fsdp["metrics"]] == [1, 2, 3]
    for m_one, m_ddp, m_fsdp in zip(one["metrics"], ddp["metrics"], fsdp["metrics"], strict=True):
        assert m_one.keys() == m_ddp.keys() == m_fsdp.keys()
        for key in KEYS[objective]:
            if key in m_one:
                assert m_fsdp[key] == pytest.approx(m_ddp[key], rel=1e-5, abs=1e-7), key
                assert m_ddp[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-7), key
    assert "val/loss" in fsdp["metrics"][-1]
    assert fsdp["metrics"][-1]["train/loss"] != fsdp["metrics"][0]["train/loss"]  # it trained
    assert one["weights"].keys() == ddp["weights"].keys() == fsdp["weights"].keys()
    assert_weights_close(fsdp["weights"], ddp["weights"])
    assert_weights_close(ddp["weights"], one["weights"])
    for m_whole, m_ddp, m_fsdp in zip(whole["metrics"], ddp["metrics"], fsdp["metrics"], strict=True):
        for key in KEYS[objective]:
            if key in m_whole:
                assert m_ddp[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key
                assert m_fsdp[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key
    assert_weights_close(ddp["weights"], whole["weights"])
    assert_weights_close(fsdp["weights"], whole["weights"])
    assert whole["forwards"] == [{"train": 3, "val": 3}]  # one micro-batch per step
    # every rank ran the same forwards: 3 steps × 2 micro-batches, and 2 validation forwards each
    assert one["forwards"] == [{"train": 12, "val": 3}]
    assert ddp["forwards"] == fsdp["forwards"] == [{"train": 6, "val": 2}] * 2
    if objective == "rm":  # the comparison catches ranks that sum their gradients instead of averaging
        summed = sgd_run(tmp_path, "summed", 2, objective, f"model.tiny={arch}", defect="summed")
        assert summed["metrics"][0]["train/loss"] == ddp["metrics"][0]["train/loss"]  # same start
        worst = max((summed["weights"][n] - w).abs().max().item() for n, w in ddp["weights"].items())
        assert worst > 1000 * ATOL
        with pytest.raises(AssertionError):
            assert_weights_close(summed["weights"], ddp["weights"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective, strategy, lora",
    [("sft", "ddp", ()), ("sft", "fsdp", ()), ("rm", "fsdp", ("lora.r=4", "lora.merge_on_save=true"))],
    ids=["sft-ddp", "sft-fsdp", "rm-lora-fsdp"],
)
def test_two_ranks_resume_from_their_checkpoint_exactly(tmp_path, objective, strategy, lora):
    """4 steps on 2 ranks straight vs. 2 ranks resumed from the first run's step-2 checkpoint: the
    same metrics and exported weights, bitwise — the resumed run repeats the same float operations
    on CPU, so any difference would mean something was not restored. Replicas' checkpoints are
    rank 0's Hugging Face directory (``model/``) that every rank reads back; sharded ones are
    ``model.dcp/``, every rank's shards of the weights and optimizer state. The LoRA case also
    exports the merged reward model gathered from the shards."""
    args = (
        f"parallel.strategy={strategy}",
        "trainer.max_steps=4",
        "trainer.save_interval=2",
        "trainer.keep_last=0",
        "resume=true",
        *lora,
    )
    full = run_worker(tmp_path, "full", 2, objective, *args)
    step_2 = tmp_path / "full" / "run" / "checkpoints" / "step_2"
    sharded = strategy == "fsdp"
    assert (step_2 / "model.dcp" / ".metadata").is_file() == sharded
    assert (step_2 / "model").is_dir() == (not sharded)
    checkpoints = tmp_path / "resumed" / "run" / "checkpoints"
    shutil.copytree(step_2, checkpoints / "step_2")
    (checkpoints / "latest").write_text("step_2\n")
    resumed = run_worker(tmp_path, "resumed", 2, objective, *args)
    assert [m["step"] for m in resumed["metrics"]] == [3, 4]
    assert resumed["metrics"][-1] | {"timing/step_s": 0} == full["metrics"][-1] | {"timing/step_s": 0}
    for name, tensor in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert resumed["forwards"] == [{"train": 4, "val": 2}] * 2  # 2 steps of 2 micro-batches


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_its_checkpoint(tmp_path):
    """SIGINT reaches rank 1 alone, in step 2 (its 3rd forward: 2 micro-batches a step): both ranks
    finish step 2, write its checkpoint together and exit 130; the same command then resumes."""
    out = tmp_path / "stopped"
    out.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    write_data(data)
    env = os.environ | {"OBJECTIVE": "sft"}
    args = [*TORCHRUN, str(WORKER), str(out), str(data), "trainer.keep_last=0", "resume=true"]
    subprocess.run(args, timeout=300, env=env | {"SIGINT_AT": "1:3"}, check=False)
    codes = [json.loads((out / f"rank{r}.json").read_text())["code"] for r in range(2)]
    assert codes == [130, 130]
    checkpoints = out / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]
    subprocess.run(args, timeout=300, env=env, check=True)
    assert [
        json.loads(line)["step"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
    ] == [
        1,
        2,
        3,
    ]


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every weight of two SGD runs within :data:`ATOL` (absolute; derived above)."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=ATOL, msg=name)


# ---------------------------------------------------------------------------- without processes
def test_each_rank_takes_an_equal_share_in_whole_micro_batches():
    assert rank_share(8, 2, 1) == 8
    assert rank_share(8, 2, 2) == 4
    assert rank_share(12, 2, 3) == 4
    with pytest.raises(StartupError) as e:
        rank_share(8, 8, 2)  # one rank would run a micro-batch the other has no share of
    message = str(e.value)
    for part in ("trainer.global_batch_size=8", "trainer.micro_batch_size=8", "2 ranks", "2 × 8 = 16"):
        assert part in message
    assert "trainer.global_batch_size=16" in message and "micro_batch_size that divides 4" in message
    with pytest.raises(
        StartupError, match=r"set trainer.global_batch_size=6 or trainer.global_batch_size=12$"
    ):
        rank_share(10, 2, 3)  # 10 does not even split over 3 ranks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 3, 5, 8])
def test_validation_micro_batches_split_contiguously_into_equal_counts(count, world):
    shares = [even_split(count, world, rank) for rank in range(world)]
    assert [i for share, _ in shares for i in share] == list(range(count))  # each once, in rank order
    assert len({len(share) + repeats for share, repeats in shares}) == 1  # the same forwards everywhere
    assert all(len(share) + repeats == -(-count // world) for share, repeats in shares)


def test_train_sft_refuses_an_uneven_split_before_loading_anything(tmp_path, monkeypatch, capsys):
    data = write_data(tmp_path)
    monkeypatch.setattr(dp, "world_size", lambda: 2)
    args = [f"data.train_path={data / 'sft.jsonl'}", f"output_dir={tmp_path / 'out'}", "device=cpu"]
    assert main(["train-sft", *args, "trainer.global_batch_size=8", "trainer.micro_batch_size=8"]) == 2
    err = capsys.readouterr().err
    assert "trainer.global_batch_size=8 does not split over 2 ranks" in err and "micro_batch_size=8" in err
    assert not (tmp_path / "out").exists()


def test_the_parallel_section_refuses_fp16_with_shards_and_has_no_train_ppo_keys():
    data = ["data.train_path=x.jsonl"]
    with pytest.raises(ConfigError, match=r"precision=fp16-mixed with parallel.strategy=fsdp"):
        load_config(SFTConfig, overrides=[*data, "parallel.strategy=fsdp", "precision=fp16-mixed"])
    # train-ppo's own keys (its initial policy, its generation) are not keys of this section
    with pytest.raises(ConfigError, match=r"unknown key 'parallel.offload_init_policy'"):
        load_config(
            SFTConfig, overrides=[*data, "parallel.strategy=fsdp", "parallel.offload_init_policy=true"]
        )
    assert load_config(SFTConfig, overrides=[*data, "parallel.strategy=fsdp"]).parallel.strategy == "fsdp"
