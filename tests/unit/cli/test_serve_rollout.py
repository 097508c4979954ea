"""serve-rollout's and train-ppo's refusals around a standalone rollout engine, without vLLM: each is
exit code 2 and one line naming the key (an engine is faked where one must answer ``GET /info``).
tests/integration/test_vllm_serve_rollout.py runs the real engine."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from openaligner.cli.main import main

YAML = Path(__file__).resolve().parents[3] / "configs" / "train_ppo.yaml"


def refused(capsys, args: list[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_serve_rollout_refuses_a_missing_model_interpreter_or_port(tmp_path, capsys):
    err = refused(capsys, ["serve-rollout"])
    assert "model" in err
    err = refused(capsys, ["serve-rollout", f"model={tmp_path}"])
    assert f"model={tmp_path} is not a Hugging Face model directory" in err
    (tmp_path / "config.json").write_text("{}")
    missing = tmp_path / "no-venv" / "bin" / "python"
    err = refused(capsys, ["serve-rollout", f"model={tmp_path}", f"vllm.python={missing}"])
    assert f"vllm.python={missing}" in err and "make rollout-setup" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exe = tmp_path / "python"  # any executable file passes the interpreter check
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        err = refused(
            capsys, ["serve-rollout", f"model={tmp_path}", f"vllm.python={exe}", f"server.port={port}"]
        )
        assert f"server.port={port} cannot be bound" in err
    err = refused(capsys, ["serve-rollout", f"model={tmp_path}", "server.port=70000"])
    assert "server.port must lie in [0, 65535]" in err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rollout.vllm.tensor_parallel_size=2"],
            "rollout.vllm.tensor_parallel_size is a setting of an engine",
        ),
        (["rollout.vllm.dtype=bfloat16"], "leave rollout.vllm.dtype at its default"),
        (["rollout.engine=hf"], "rollout.vllm.url is set but rollout.engine=hf"),
        (["rollout.vllm.url=localhost:5557"], "rollout.vllm.url must be http://HOST:PORT"),
        (
            ["rollout.vllm.url=http://127.0.0.1:5557,http://127.0.0.1:5558,http://127.0.0.1:5557/"],
            "rollout.vllm.url names http://127.0.0.1:5557 more than once",
        ),
        (["rollout.vllm.url=http://127.0.0.1:5557,localhost:5558"], "must be http://HOST:PORT"),
        (
            ["rollout.vllm.weight_transfer=nccl"],
            "rollout.vllm.weight_transfer must be one of auto, http, collective",
        ),
    ],
)
def test_train_ppo_refuses_settings_that_conflict_with_an_attached_engine(capsys, overrides, expected):
    args = ["data.train_path=x.jsonl", "rollout.engine=vllm", "rollout.vllm.url=http://127.0.0.1:5557"]
    assert expected in refused(capsys, ["train-ppo", str(YAML), *args, *overrides])


class FakeEngine:
    """Answers ``GET /info`` as a standalone engine would, with ``info`` merged in."""

    def __init__(self, **info) -> None:
        model = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64}
        self.info = {
            "model": model,
            "dtype": "float32",
            "standalone": True,
            "workdir": "/nonexistent",
            "lease": None,
            "lease_ttl_s": 60.0,
        } | info
        payload = json.dumps(self.info).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                return None

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LEASED = {"lease": {"holder": "other:7", "idle_s": 1.0}}
MODEL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 999, "hidden_size": 64}


def attached_run(tmp_path: Path, url: str) -> list[str]:
    """train-ppo's command line for a tiny actor attached to the engine(s) at ``url``."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(64)))
    return [
        "train-ppo",
        str(YAML),
        f"data.train_path={prompts}",
        "actor.tiny=llama",
        "actor.tiny_num_heads=2",
        "remote.critic.port=1",
        "device=cpu",
        "rollout.engine=vllm",
        f"rollout.vllm.url={url}",
    ]


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (None, "no vllm rollout engine answers there"),
        ({"model": MODEL}, "serves another model than the actor: vocab_size 999"),
        ({"model": {**MODEL, "vocab_size": 100, "architectures": ["Qwen2ForCausalLM"]}}, "architectures"),
        (LEASED, "is attached to another trainer (other:7"),
        ({"standalone": False}, "is an engine another run started for itself"),
    ],
)
def test_train_ppo_refuses_an_engine_it_cannot_attach_to_at_start_up(tmp_path, capsys, info, expected):
    engine = FakeEngine(**info) if info is not None else None
    url = engine.url if engine is not None else f"http://127.0.0.1:{_free_port()}"
    try:
        err = refused(capsys, attached_run(tmp_path, url))
    finally:
        if engine is not None:
            engine.close()
    assert f"rollout.vllm.url={url}" in err and expected in err, err


def test_train_ppo_names_the_one_of_several_engines_it_cannot_attach_to(tmp_path, capsys):
    good, bad = FakeEngine(model={**MODEL, "vocab_size": 100}), FakeEngine(**LEASED)
    try:
        err = refused(capsys, attached_run(tmp_path, f"{good.url},{bad.url}"))
    finally:
        good.close()
        bad.close()
    assert f"{bad.url} (of rollout.vllm.url) is attached to another trainer (other:7" in err, err
