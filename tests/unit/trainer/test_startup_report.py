"""Before the first step a supervised run says what it is doing (reading data, loading the model,
each with its time) and what it trains: parameter count, dtype, device, precision, the size of
a checkpoint and the memory of weights, gradients and AdamW state (issue 31, item 2)."""

from __future__ import annotations

import json
import logging

from safetensors.torch import load_file

from openaligner.cli.main import main
from openaligner.io.checkpoint import human_size
from openaligner.trainer.startup import count


def test_train_sft_reports_each_start_up_phase_and_the_model(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="openaligner.trainer")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f" a{i}"}) + "\n" for i in range(16)))
    out = tmp_path / "out"
    args = [
        f"data.train_path={data}",
        f"output_dir={out}",
        "trainer.max_steps=1",
        "trainer.global_batch_size=8",
    ]
    assert main(["train-sft", *args, "progress=false", "device=cpu"]) == 0
    said = [r.getMessage() for r in caplog.records]
    params = sum(t.numel() for t in load_file(out / "model.safetensors").values())
    expected = [
        f"reading data.train_path={data}…",
        f"reading data.train_path={data}: done in ",
        "loading the model (model.tiny=gpt2) onto cpu…",
        "loading the model (model.tiny=gpt2) onto cpu: done in ",
        f"model: {count(params)} parameters ({count(params)} trained), float32 masters on cpu, "
        f"precision fp32; each checkpoint ≈ {human_size(12 * params)}; weights, gradients and AdamW state ≈ "
        f"{human_size(16 * params)} of memory, plus activations",
        "data: 14 training and 2 validation items; 1 step(s) of 8 (1 epoch(s) at most)",
    ]
    starts = [next((m for m in said if m.startswith(e)), None) for e in expected]
    assert None not in starts, (expected, said)
    assert [said.index(m) for m in starts] == sorted(said.index(m) for m in starts)  # in this order


def test_count():
    assert [count(n) for n in (12, 36_864, 268_098_176, 1_235_814_400)] == ["12", "36.9 k", "268 M", "1.24 B"]


def test_the_estimate_leaves_the_first_step_out_and_speaks_once():
    from openaligner.trainer.startup import RunEstimate

    # resumed at step 10 of 110: step 11 takes 30 s (warm-up), steps 12 and 13 take 2 s each
    times = iter([30.0, 32.0, 34.0, 36.0, 38.0])
    estimate = RunEstimate(10, 110, clock=lambda: next(times), wall_clock=lambda: 0.0)
    estimate.step_done(11)
    estimate.step_done(12)
    assert estimate.said is None
    estimate.step_done(13)
    said = estimate.said
    assert said is not None and said.startswith(
        "speed: 2 s/step over steps 12-13; the remaining 97 step(s) take about 3 min (done around "
    )
    estimate.step_done(14)
    assert estimate.said == said


def test_train_sft_logs_an_estimate_after_its_first_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="openaligner.trainer")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f" a{i}"}) + "\n" for i in range(16)))
    args = [f"data.train_path={data}", f"output_dir={tmp_path / 'out'}", "trainer.max_steps=6"]
    assert main(["train-sft", *args, "trainer.global_batch_size=8", "progress=false", "device=cpu"]) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speed: ")]
    assert len(said) == 1 and " s/step over steps 2-3; the remaining 3 step(s) take about " in said[0]
