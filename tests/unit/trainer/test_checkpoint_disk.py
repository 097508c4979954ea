"""What a supervised checkpoint costs on disk, as docs/models.md#disk states it: 12 bytes per
trained parameter (float32 master weights, AdamW's two float32 moments) plus a few tens of kB;
each checkpoint's size is logged as it is written; one checkpoint is kept by default; the final
export is weights only, in save_dtype."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from safetensors.torch import load_file

from openaligner.cli.main import main
from openaligner.config import load_config
from openaligner.io.checkpoint import directory_size, human_size
from openaligner.trainer.sft import SFTConfig


def _train(tmp_path: Path, *extra: str) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f" a{i}"}) + "\n" for i in range(16)))
    out = tmp_path / "out"
    args = [f"data.train_path={data}", f"output_dir={out}", "model.tiny_hidden_size=128"]
    args += ["model.tiny_num_layers=2", "trainer.max_steps=2", "trainer.save_interval=1"]
    assert (
        main(["train-sft", *args, "trainer.global_batch_size=8", "progress=false", "device=cpu", *extra]) == 0
    )
    return out


def test_a_checkpoint_costs_12_bytes_per_parameter_and_its_size_is_logged(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="openaligner.io.checkpoint")
    out = _train(tmp_path, "save_dtype=bf16")
    params = sum(
        t.numel() for t in load_file(out / "checkpoints" / "step_2" / "model" / "model.safetensors").values()
    )
    size = directory_size(out / "checkpoints" / "step_2")
    assert 12 * params <= size <= 12 * params + 100_000, (params, size)
    # keep_last=1 by default: only the newest checkpoint stays
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2"]
    logged = [r.getMessage() for r in caplog.records if "written:" in r.getMessage()]
    assert len(logged) == 2 and logged[-1] == (
        f"checkpoint {out / 'checkpoints' / 'step_2'} written: {human_size(size)} "
        "(1 checkpoint(s) kept, keep_last=1)"
    )
    # the final export: weights only, 2 bytes per parameter in bf16, its size on the closing line
    weights = (out / "model.safetensors").stat().st_size
    assert 2 * params <= weights <= 2 * params + 20_000
    assert f"(weights {human_size(weights)})" in capsys.readouterr().out


def test_keep_last_defaults_to_one():
    assert load_config(SFTConfig, overrides=["data.train_path=x"]).trainer.keep_last == 1


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (999, "999 B"), (1500, "1.5 kB"), (3.24e9, "3.24 GB")])
def test_human_size(n, text):
    assert human_size(n) == text
