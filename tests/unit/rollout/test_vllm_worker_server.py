"""The vLLM engine's HTTP side without vLLM (a fake ``vllm.LLM`` that records reloads): a
standalone engine serves one leased trainer at a time, takes weight uploads only whole and
well-formed, reloads only from its own directory, and answers every bad request with a 4xx
naming what was wrong while it goes on serving. tests/integration/test_vllm_serve_rollout.py runs
the real engine."""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import HTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.rollout import vllm_worker


class FakeLLM:
    def __init__(self) -> None:
        self.reloads: list[tuple[str, list[str]]] = []

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        path = kwargs["weights_path"]
        self.reloads.append((method, sorted(p.name for p in Path(path).iterdir())))

    def reset_prefix_cache(self) -> None:
        return None


@pytest.fixture
def engine(tmp_path):
    model = tmp_path / "model"
    build_tiny_causal_lm("llama", TinySize(vocab_size=100, num_heads=2), seed=0).save_pretrained(model)
    workdir = tmp_path / "work"
    workdir.mkdir()
    args = vllm_worker.parser().parse_args(
        [f"--model={model}", "--ready-file=x", f"--workdir={workdir}", "--standalone", "--lease-ttl-s=2"]
    )
    llm = FakeLLM()
    server = HTTPServer(("127.0.0.1", 0), vllm_worker.make_handler(vllm_worker.Engine(args, llm=llm)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], llm, workdir
    server.shutdown()
    server.server_close()


def call(port: int, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers=headers or {})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def lease(token: str) -> dict:
    return {vllm_worker.LEASE_HEADER: token}


def test_info_reports_the_model_and_one_trainer_holds_the_engine_at_a_time(engine):
    port, _, workdir = engine
    code, info = call(port, "GET", "/info")
    assert code == 200 and info["standalone"] and info["lease"] is None
    assert info["model"]["vocab_size"] == 100 and info["model"]["architectures"] == ["LlamaForCausalLM"]
    token = (workdir / "local-token").read_text()
    code, first = call(port, "POST", "/attach", {"client": "a:1", "local_token": token})
    assert code == 200 and first["local"] and first["weights_dir"] == str(workdir.resolve() / "weights")
    code, reply = call(port, "POST", "/attach", {"client": "b:2", "local_token": "guess"})
    assert code == 409 and "attached to another trainer (a:1" in reply["error"]
    code, reply = call(port, "POST", "/generate", {"prompts": [[5]]}, lease("not-the-lease"))
    assert code == 409 and "POST /attach" in reply["error"]
    assert call(port, "POST", "/heartbeat", {}, lease(first["lease"])) == (200, {"ok": True})
    # the lease lapses without a request: the next trainer may take the engine (a lease of 2 s
    # leaves the calls above room on a loaded machine: b:2 must come while a:1 still holds it)
    time.sleep(2.2)
    code, second = call(port, "POST", "/attach", {"client": "b:2", "local_token": "guess"})
    assert code == 200 and not second["local"]
    code, reply = call(port, "POST", "/heartbeat", {}, lease(first["lease"]))
    assert code == 409 and "attached to b:2" in reply["error"]
    # a body size that is not a number is the client's mistake (it was answered 500 before)
    code, reply = call(port, "POST", "/heartbeat", b"{}", {**lease(second["lease"]), "Content-Length": "x"})
    assert code == 400 and "Content-Length must be a byte count" in reply["error"]
    assert call(port, "POST", "/detach", {}, lease(second["lease"])) == (200, {"ok": True})
    assert call(port, "GET", "/info")[1]["lease"] is None


def test_an_upload_is_taken_only_whole_and_well_formed_and_reloaded_from_the_engines_directory(engine):
    port, llm, workdir = engine
    token = call(port, "POST", "/attach", {"client": "a:1"})[1]["lease"]
    weights = workdir / "weights" / "model.safetensors"
    data = save({"w": torch.ones(4, 4)})
    # no lease; no size; a size that is not a number; not safetensors; a header that describes more
    assert call(port, "PUT", "/weights", data, {"Content-Length": str(len(data))})[0] == 409
    code, reply = call(port, "PUT", "/weights", b"", lease(token))
    assert code == 400 and "Content-Length" in reply["error"]
    code, reply = call(port, "PUT", "/weights", b"x" * 16, {**lease(token), "Content-Length": "lots"})
    assert code == 400 and "Content-Length must be a byte count" in reply["error"]
    code, reply = call(port, "PUT", "/weights", b"\xff" * 64, lease(token))
    assert code == 400 and "not a safetensors file" in reply["error"]
    code, reply = call(port, "PUT", "/weights", data[:-4], lease(token))
    assert code == 400 and "describes other data" in reply["error"]
    assert sorted(p.name for p in weights.parent.iterdir()) == []  # nothing half-written left
    code, reply = call(port, "POST", "/reload_weights", {}, lease(token))
    assert code == 400 and "holds no .safetensors file" in reply["error"]
    assert llm.reloads == []
    # a path outside the engine's own directory is never loaded
    code, reply = call(port, "POST", "/reload_weights", {"path": str(workdir.parent)}, lease(token))
    assert code == 400 and "must lie in the engine's directory" in reply["error"]

    assert call(port, "PUT", "/weights", data, lease(token)) == (200, {"bytes": len(data)})
    code, reply = call(port, "POST", "/reload_weights", {}, lease(token))
    assert code == 200 and llm.reloads == [("reload_weights", ["model.safetensors"])]
    assert not weights.exists()  # loaded: no second copy of the model kept in memory
    assert call(port, "GET", "/health") == (200, {"ok": True})


def test_a_spawned_engine_has_no_lease_and_refuses_the_standalone_endpoints(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    args = vllm_worker.parser().parse_args([f"--model={model}", "--ready-file=x", f"--workdir={tmp_path}"])
    engine = vllm_worker.Engine(args, llm=FakeLLM())
    assert engine.info()["standalone"] is False and engine.info()["model"] == {}
    engine.check_lease(None)  # its one trainer needs none
    with pytest.raises(vllm_worker.BadRequest, match=r"/attach is for a standalone engine"):
        engine.attach({"client": "a"})


@pytest.mark.parametrize("transfer", ["auto", "http"])
def test_an_attached_trainer_keeps_its_lease_pushes_its_weights_and_detaches(tmp_path, transfer):
    from openaligner.models.actor import CausalLMActor
    from openaligner.rollout.vllm_config import VLLMConfig
    from openaligner.rollout.vllm_engine import VLLMRolloutEngine

    tiny = build_tiny_causal_lm("llama", TinySize(vocab_size=100, num_heads=2), seed=0)
    tiny.save_pretrained(tmp_path / "model")
    (tmp_path / "work").mkdir()
    args = vllm_worker.parser().parse_args(
        [f"--model={tmp_path / 'model'}", "--ready-file=x", f"--workdir={tmp_path / 'work'}", "--standalone"]
    )
    args.lease_ttl_s = 4.0  # heartbeats every 1 s: three may be late before the lease would lapse
    llm = FakeLLM()
    server = HTTPServer(("127.0.0.1", 0), vllm_worker.make_handler(vllm_worker.Engine(args, llm=llm)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        actor = CausalLMActor(tiny, init_policy=False)
        cfg = VLLMConfig(url=f"http://127.0.0.1:{port}", weight_transfer=transfer)
        with VLLMRolloutEngine(actor, cfg) as engine:
            # same machine: through the engine's directory unless told to upload
            assert (engine.links[0].local_dir is not None) == (transfer == "auto")
            time.sleep(5.0)  # longer than the lease: the heartbeat keeps it
            code, reply = call(port, "POST", "/attach", {"client": "b:2"})
            assert code == 409 and "attached to another trainer" in reply["error"]
            engine._push()  # what the first generate does
            assert llm.reloads == [("reload_weights", ["model.safetensors"])]
            assert set(engine.pop_metrics()) == {"timing/weight_sync_s"}
        assert call(port, "GET", "/info")[1]["lease"] is None  # detached; the engine serves on
    finally:
        server.shutdown()
        server.server_close()
