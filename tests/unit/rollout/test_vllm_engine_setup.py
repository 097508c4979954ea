"""The vllm engine's trainer side that needs no vLLM: the weights it writes and where it looks for
its interpreter (tests/integration/test_vllm_engine.py runs the engine itself)."""

from __future__ import annotations

import pytest
import torch

from openaligner.rollout.engine import EngineSetupError
from openaligner.rollout.vllm_link import resolve_python
from openaligner.rollout.weights_file import engine_state_dict


def test_engine_state_dict_unties_copies_casts_and_names_the_tied_head(tiny):
    model = tiny.causal_lm("qwen2")  # ties its LM head to the input embedding
    state = model.state_dict()
    out = engine_state_dict(state, torch.bfloat16, tied=True)
    assert out["lm_head.weight"].data_ptr() != out["model.embed_tokens.weight"].data_ptr()
    assert torch.equal(out["lm_head.weight"].float(), state["model.embed_tokens.weight"].bfloat16().float())
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    assert len({t.data_ptr() for t in out.values()}) == len(out)  # safetensors refuses shared memory
    # a state dict that lacks the head gets it from the embedding
    headless = {k: v for k, v in state.items() if k != "lm_head.weight"}
    head = engine_state_dict(headless, torch.float32, tied=True)["lm_head.weight"]
    assert torch.equal(head, state["model.embed_tokens.weight"])
    assert "lm_head.weight" not in engine_state_dict(headless, torch.float32, tied=False)


def test_missing_interpreter_names_the_key_and_the_make_target(tmp_path):
    with pytest.raises(EngineSetupError, match=r"rollout\.vllm\.python=.*make rollout-setup"):
        resolve_python(str(tmp_path / "nope" / "python"))
    assert resolve_python("/bin/sh").name == "sh"


def test_the_engine_process_runs_the_worker_script_by_path_in_isolated_mode(tmp_path, monkeypatch):
    """The rollout venv's Python runs ``rollout/vllm_worker.py`` by its path with ``-I`` (no
    PYTHONPATH, and not the script's directory, whose ``config.py`` / ``engine.py`` would shadow
    modules of those names): the file must be where the link says, and import nothing of ours."""
    import ast
    import subprocess
    from pathlib import Path

    from openaligner.rollout import vllm_link
    from openaligner.rollout.vllm_config import VLLMProcessConfig

    seen = {}

    class Recorder:
        def __init__(self, cmd, **kwargs):
            seen.update(cmd=cmd, env=kwargs["env"])

    monkeypatch.setattr(subprocess, "Popen", Recorder)
    vllm_link.spawn_worker(Path("/venv/bin/python"), tmp_path, tmp_path, VLLMProcessConfig(), None, [])
    worker = Path(vllm_link.__file__).with_name("vllm_worker.py")
    assert seen["cmd"][:3] == ["/venv/bin/python", "-I", str(worker)] and worker.is_file()
    assert "PYTHONPATH" not in seen["env"]
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(ast.parse(worker.read_text()))
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not [m for m in imported if m.startswith("openaligner")], imported
