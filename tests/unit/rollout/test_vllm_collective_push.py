"""``rollout.vllm.weight_transfer=collective`` without vLLM: the trainer broadcasts the weights over
a two-member process group (gloo here; NCCL where the engine has a GPU) into a real engine server
(``vllm_worker``) over a fake ``vllm.LLM`` that records what it reloads. The engine gets exactly
the trainer's tensors in its dtype; the group is built once and rebuilt after a failure; bad
plans and broken broadcasts are answered with a 4xx/502 naming what was wrong while the engine
serves on. tests/integration/test_vllm_engine.py pushes into real vLLM this way."""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from test_vllm_several_engines import FakeSamplingParams, Served, actor, request, serve

from openaligner.models.actor import CausalLMActor
from openaligner.rollout import vllm_worker
from openaligner.rollout.engine import RolloutEngineError
from openaligner.rollout.vllm_config import VLLMConfig
from openaligner.rollout.vllm_engine import VLLMRolloutEngine
from openaligner.rollout.weights_file import engine_state_dict


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=FakeSamplingParams))


def post(url: str, path: str, body: dict, lease: str | None = None) -> tuple[int, dict]:
    headers = {vllm_worker.LEASE_HEADER: lease} if lease else {}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextmanager
def pushing(
    tmp_path: Path, a: CausalLMActor, *extra: str, name: str = "a", **cfg: Any
) -> Iterator[tuple[Served, VLLMRolloutEngine]]:
    """An engine server ``name`` over the fake ``vllm.LLM`` (``extra``: its flags) and the trainer's
    engine for ``a`` pushing into it over the collective (``cfg``: more :class:`VLLMConfig`
    fields); both closed on the way out."""
    with (
        serve(tmp_path, name, *extra) as s,
        VLLMRolloutEngine(a, VLLMConfig(url=s.url, weight_transfer="collective", **cfg)) as engine,
    ):
        yield s, engine


def test_bucket_layout_aligns_and_caps_every_bucket():
    layout = vllm_worker.bucket_layout([10, 6, 40, 100, 0, 3], bucket_bytes=64)
    # offsets aligned to 16 bytes; a tensor that would overrun 64 bytes starts the next bucket;
    # one larger than a bucket (100) goes alone
    assert layout == [[(0, 0, 10), (1, 16, 6)], [(2, 0, 40)], [(3, 0, 100)], [(4, 0, 0), (5, 0, 3)]]
    assert [vllm_worker.bucket_bytes_of(b) for b in layout] == [22, 40, 100, 3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_reloads_exactly_the_trainers_tensors_in_its_dtype(fake_vllm, tmp_path, dtype):
    a = actor()
    with pushing(tmp_path, a, f"--dtype={dtype}") as (s, engine):
        groups = []
        for version in (1, 2):
            with torch.no_grad():
                for p in a.model.parameters():
                    p.mul_(1.5)
            engine.update_weights(a, version)
            engine.generate(request(a, 2))
            groups.append(engine.links[0]._group)
            want = engine_state_dict(a.model.state_dict(), getattr(torch, dtype), tied=False)
            got = s.llm.reloaded[-1]
            assert list(got) == list(want)
            for name, t in want.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert engine.pop_metrics()["timing/weight_sync_s"] > 0
        assert groups[0] is groups[1] is not None  # one group for the run, reused by every push
        # the engine loses its end (e.g. its receive failed after a timeout): the next push
        # builds a new group instead of failing at every step from then on
        s.engine.collective = None
        engine.update_weights(a, 3)
        engine.generate(request(a, 2))
        assert engine.links[0]._group is not groups[0] and len(s.llm.reloaded) == 3


def test_bad_plans_are_refused_before_any_broadcast_and_a_broken_one_ends_the_group(fake_vllm, tmp_path):
    with serve(tmp_path, "a") as s:
        code, reply = post(s.url, "/attach", {"client": "t:1"})
        lease = reply["lease"]
        good_plan = {"push": "p1", "tensors": [["w", "float32", [2, 3]]], "bucket_bytes": 1024}
        code, reply = post(s.url, "/collective/plan", good_plan, lease)
        assert code == 409 and "POST /collective/init first" in reply["error"]
        code, reply = post(s.url, "/collective/receive", {}, lease)
        assert code == 409 and "/collective/plan first" in reply["error"]

        # the trainer's end of a group, built by hand; the engine joins with a 3 s timeout (a
        # margin for a loaded machine; the receive below waits it out)
        store = tdist.TCPStore(
            "127.0.0.1", 0, 2, True, datetime.timedelta(seconds=30), wait_for_workers=False
        )
        mine: dict[str, Any] = {}

        def build() -> None:
            prefixed = tdist.PrefixStore("openaligner-weights", store)
            mine["group"] = tdist.ProcessGroupGloo(prefixed, 0, 2, datetime.timedelta(seconds=30))

        builder = threading.Thread(target=build)
        builder.start()
        code, reply = post(
            s.url, "/collective/init", {"host": "127.0.0.1", "port": store.port, "timeout_s": 3}, lease
        )
        builder.join()
        assert (code, reply) == (200, {"backend": "gloo"})

        for change, words in [
            ({"push": None}, "push must be a string of 1-64 characters"),
            ({"tensors": [["w", "complex64", [2]]]}, "dtype one of float32"),
            ({"tensors": [["w", "float32", 3]]}, "shape a list"),
            ({"tensors": [["w", "float32", [-1]]]}, "tensors[0] shape must hold integers"),
            ({"tensors": [["", "float32", [1]]]}, "must be [name, dtype, shape]"),
            ({"tensors": []}, "tensors must be a non-empty list"),
            ({"bucket_bytes": 0}, "bucket_bytes"),
            ({"tensors": [["w", "float32", [1 << 30, 1 << 30]]]}, "over the engine's free memory"),
        ]:
            code, reply = post(s.url, "/collective/plan", {**good_plan, **change}, lease)
            assert 400 <= code < 500 and words in reply["error"], (change, reply)
        assert post(s.url, "/collective/receive", {}, lease)[0] == 409  # a refused plan is no plan

        # planned, but the trainer never broadcasts: the engine's broadcast times out (3 s)
        assert post(s.url, "/collective/plan", good_plan, lease)[0] == 200
        code, reply = post(s.url, "/collective/receive", {}, lease)
        assert (
            code == 502 and "did not arrive" in reply["error"] and "/collective/init again" in reply["error"]
        )
        assert post(s.url, "/collective/plan", good_plan, lease)[0] == 409  # the group is gone
        body = {
            "prompts": [[5, 6]], "seeds": [0], "greedy": True, "temperature": 1.0, "top_k": -1,
            "top_p": 1.0, "max_tokens": 3, "min_tokens": 0, "stop_token_ids": [1],
        }  # fmt: skip
        # the weights were streaming into the reload when the broadcast failed: part old, part new,
        # so the engine generates nothing until a push succeeds (and serves on meanwhile)
        code, reply = post(s.url, "/generate", body, lease)
        assert code == 409 and "push the weights again before generating" in reply["error"]
        assert post(s.url, "/heartbeat", {}, lease)[0] == 200
        assert s.llm.reloaded == []


def test_a_broadcast_that_fails_is_named_and_the_next_push_builds_a_new_group(fake_vllm, tmp_path):
    a = actor()
    with pushing(tmp_path, a, request_timeout_s=10.0) as (s, engine):
        engine.generate(request(a, 2))
        link = engine.links[0]
        # this side's broadcast fails (the connection lost): the engine's receive times out
        # (10 s: every request of this run has that limit, a margin for a loaded machine) and
        # ends its group
        link._group = broken = types.SimpleNamespace(broadcast=_failing_broadcast)
        engine.update_weights(a, 1)
        with pytest.raises(
            RolloutEngineError, match=rf"{s.url} did not take the weights over the collective"
        ):
            engine.generate(request(a, 2))
        assert link._group is None and len(s.llm.reloaded) == 1
        engine.update_weights(a, 2)
        engine.generate(request(a, 2))  # a new group, and the push arrives
        assert link._group is not None and link._group is not broken
        assert len(s.llm.reloaded) == 2


def _failing_broadcast(*args: Any) -> Any:
    raise RuntimeError("Connection closed by peer")


def test_an_upload_without_an_attached_engine_is_refused():
    """An engine the run starts reads /dev/shm or takes a broadcast; ``http`` there meant nothing
    and was silently ignored."""
    with pytest.raises(
        ValueError, match=r"weight_transfer=http uploads to an engine of openaligner serve-rollout"
    ):
        VLLMConfig(weight_transfer="http")
    assert VLLMConfig(weight_transfer="collective").weight_transfer == "collective"


def test_an_nccl_engine_is_refused_by_a_trainer_without_a_gpu_or_on_the_engines_gpu(
    fake_vllm, tmp_path, monkeypatch
):
    """NCCL needs a GPU on both sides, and two of them: it cannot join two processes on one GPU
    (a colocated engine), which would otherwise fail deep inside NCCL at the first push."""
    monkeypatch.setattr(vllm_worker, "_collective_backend", lambda: "nccl")
    monkeypatch.setattr(vllm_worker, "_gpu_uuid", lambda: "GPU-1")
    a = actor()
    with pushing(tmp_path, a) as (s, engine):
        with pytest.raises(
            RolloutEngineError,
            match=r"has a GPU \(its weights come over NCCL\) and this trainer runs on the CPU: set "
            r"rollout.vllm.weight_transfer=auto",
        ):
            engine.generate(request(a, 2))
        # a trainer on the engine's GPU (the same UUID)
        engine.device = torch.device("cuda", 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
        props = types.SimpleNamespace(uuid="GPU-1")
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
        with pytest.raises(RolloutEngineError, match=r"runs on this trainer's GPU, and NCCL cannot join"):
            engine.generate(request(a, 2))
    assert s.llm.reloaded == []


def test_a_refused_receive_or_group_does_not_leave_the_trainer_waiting_out_its_timeout(
    fake_vllm, tmp_path, monkeypatch
):
    """The trainer broadcasts only once the engine is receiving, and builds its end of the group
    only once the engine is joining: a refusal before either is raised at once, where a send to
    an engine that refused blocked until the group's timeout (here 120 s) and a refused init left
    a thread waiting in the group's construction."""
    lose = vllm_worker.Engine.collective_plan

    def plan_then_lose_it(self: vllm_worker.Engine, body: dict) -> dict:
        out = lose(self, body)
        self.plan = None  # as a lapsed lease or a restart would: the receive is refused (409)
        return out

    a = actor()
    monkeypatch.setattr(vllm_worker.Engine, "collective_plan", plan_then_lose_it)
    # the server's routes take the patched plan
    with pushing(tmp_path, a, request_timeout_s=120.0) as (_, engine):
        t0 = time.monotonic()
        with pytest.raises(RolloutEngineError, match=r"refused /collective/receive: .*no planned push"):
            engine.generate(request(a, 2))
        assert time.monotonic() - t0 < 30.0

    def refuse(self: vllm_worker.Engine, body: dict) -> dict:
        raise vllm_worker.BadRequest("no group here (test)")

    monkeypatch.setattr(vllm_worker.Engine, "collective_init", refuse)
    with pushing(tmp_path, a, name="b", request_timeout_s=120.0) as (_, engine):
        t0 = time.monotonic()
        with pytest.raises(RolloutEngineError, match=r"refused /collective/init: .*no group here"):
            engine.generate(request(a, 2))
        assert time.monotonic() - t0 < 30.0
        assert not [t for t in threading.enumerate() if t.name == "vllm-group" and t.is_alive()]
