"""One run, several standalone engines (``rollout.vllm.url=http://A,http://B``), without vLLM: two
real engine servers (``vllm_worker``) over a fake ``vllm.LLM`` whose tokens depend only on a row's
prompt and seed, as vLLM's do with per-row seeds. The rows are shared among the engines and come
back in order, equal to one engine's; every push reaches every engine; an engine that refuses or
dies is named. tests/integration/test_vllm_serve_rollout.py runs two real engines."""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.generation import SamplingParams
from openaligner.rollout import vllm_worker
from openaligner.rollout.engine import EngineSetupError, RolloutEngineError, RolloutRequest, row_seeds
from openaligner.rollout.vllm_config import VLLMConfig, engine_urls
from openaligner.rollout.vllm_engine import VLLMRolloutEngine, split_rows

SIZE = TinySize(vocab_size=100, num_heads=2)


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class FakeLLM:
    """Tokens a function of the row's prompt and seed alone; records the rows each call got and
    the weights each reload found."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.reloaded: list[dict[str, torch.Tensor]] = []

    def generate(self, prompts: list, sampling_params: list, use_tqdm: bool) -> list:
        self.rows.append(len(prompts))
        ns = types.SimpleNamespace
        outs = []
        for p, params in zip(prompts, sampling_params, strict=True):
            seed, ids = params.kwargs["seed"], p["prompt_token_ids"]
            tokens = [3 + (seed * 7 + sum(ids) + k) % 90 for k in range(3)]
            logprobs = [{t: ns(logprob=-0.01 * (t % 10))} for t in tokens]
            outs.append(ns(outputs=[ns(token_ids=tokens, logprobs=logprobs, finish_reason="length")]))
        return outs

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        if "weights_iterator" in kwargs:  # weight_transfer=collective: the tensors themselves
            self.reloaded.append({name: t.clone() for name, t in kwargs["weights_iterator"]})
        else:
            self.reloaded.append(load_file(str(Path(kwargs["weights_path"]) / "model.safetensors")))

    def reset_prefix_cache(self) -> None:
        return None


class Served(types.SimpleNamespace):
    """A running engine server; ``with serve(...) as s:`` stops it on the way out."""

    url: str
    llm: FakeLLM
    engine: vllm_worker.Engine
    server: Any

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(tmp_path: Path, name: str, *extra: str) -> Served:
    """A standalone engine server on a free port, over a :class:`FakeLLM`."""
    model = tmp_path / f"{name}-model"
    build_tiny_causal_lm("llama", SIZE, seed=3).save_pretrained(model)
    workdir = tmp_path / f"{name}-work"
    workdir.mkdir()
    args = vllm_worker.parser().parse_args(
        [
            f"--model={model}",
            "--ready-file=x",
            f"--workdir={workdir}",
            "--standalone",
            "--lease-ttl-s=60",
            *extra,
        ]
    )
    llm = FakeLLM()
    engine = vllm_worker.Engine(args, llm=llm)
    server = vllm_worker.make_server(engine, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return Served(url=f"http://127.0.0.1:{server.server_address[1]}", llm=llm, engine=engine, server=server)


@pytest.fixture
def engines(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=FakeSamplingParams))
    served = [serve(tmp_path, "a"), serve(tmp_path, "b")]
    yield served
    for s in served:
        s.close()


def lease_of(s: Served) -> Any:
    import json
    import urllib.request

    with urllib.request.urlopen(s.url + "/info", timeout=10) as r:
        return json.loads(r.read())["lease"]


def actor() -> CausalLMActor:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(1,))
    return CausalLMActor(build_tiny_causal_lm("llama", SIZE, seed=1), sampling=sampling, init_policy=False)


def request(a: CausalLMActor, rows: int) -> RolloutRequest:
    prompts = torch.randint(3, SIZE.vocab_size, (rows, 6), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([6, 4, 5, 2, 6, 3, 1][:rows])
    return RolloutRequest(prompts, lengths, a.sampling, row_seeds(10, rows))


def test_split_rows_is_contiguous_and_even():
    assert split_rows(5, 2) == [slice(0, 3), slice(3, 5)]
    assert split_rows(1, 3) == [slice(0, 1), slice(1, 1), slice(1, 1)]
    for rows in range(9):
        for parts in range(1, 4):
            sizes = [s.stop - s.start for s in split_rows(rows, parts)]
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("transfer", ["auto", "http", "collective"])
def test_the_rows_are_shared_among_the_engines_and_every_push_reaches_each(engines, transfer):
    a_, b_ = engines
    a = actor()
    req = request(a, 5)
    with VLLMRolloutEngine(a, VLLMConfig(url=a_.url, weight_transfer=transfer)) as one:
        alone = one.generate(req)
    assert a_.llm.rows == [5]
    urls = f"{a_.url},{b_.url}/"  # a trailing slash is the same URL
    with VLLMRolloutEngine(a, VLLMConfig(url=urls, weight_transfer=transfer)) as two:
        assert lease_of(a_) is not None and lease_of(b_) is not None  # both held by this run
        both = two.generate(req)
        assert a_.llm.rows == [5, 3] and b_.llm.rows == [2]  # a contiguous share each, at once
        # the rows come back in order, as one engine gives them (a row's tokens are its seed's)
        assert torch.equal(both.tokens, alone.tokens)
        assert both.logprobs is not None and alone.logprobs is not None
        assert torch.equal(both.logprobs, alone.logprobs)
        assert torch.equal(both.sequence_lengths, alone.sequence_lengths)
        # the first rollout pushed the actor's weights into both engines
        assert len(a_.llm.reloaded) == 2 and len(b_.llm.reloaded) == 1
        with torch.no_grad():
            for p in a.model.parameters():
                p.add_(0.5)
        two.update_weights(a, version=1)
        two.generate(request(a, 1))  # one row: only the first engine generates, both are pushed
        assert a_.llm.rows == [5, 3, 1] and b_.llm.rows == [2]
        assert len(a_.llm.reloaded) == 3 and len(b_.llm.reloaded) == 2
        mine = a.model.state_dict()["model.embed_tokens.weight"]
        for pushed in (a_.llm.reloaded[-1], b_.llm.reloaded[-1]):
            assert torch.equal(pushed["model.embed_tokens.weight"], mine)
    assert lease_of(a_) is None and lease_of(b_) is None  # both given back; both serve on


def test_an_engine_named_twice_is_refused():
    with pytest.raises(ValueError, match=r"names http://127.0.0.1:5557 more than once"):
        VLLMConfig(url="http://127.0.0.1:5557,http://127.0.0.1:5557/")
    with pytest.raises(ValueError, match=r"must be http://HOST:PORT.*'127.0.0.1:5558'"):
        engine_urls("http://127.0.0.1:5557,127.0.0.1:5558")


def test_one_engine_under_two_names_is_refused(engines):
    a_ = engines[0]
    other_name = a_.url.replace("127.0.0.1", "localhost")
    with pytest.raises(EngineSetupError, match=rf"{a_.url} and {other_name} are one engine"):
        VLLMRolloutEngine(actor(), VLLMConfig(url=f"{a_.url},{other_name}"))


def test_engines_of_different_dtypes_are_refused(engines, tmp_path):
    with (
        serve(tmp_path, "c", "--dtype=bfloat16") as c,
        pytest.raises(EngineSetupError, match=r"different dtypes \(bfloat16, float32\)"),
    ):
        VLLMRolloutEngine(actor(), VLLMConfig(url=f"{engines[0].url},{c.url}"))


def test_an_engine_taken_before_the_lease_is_named_and_the_leases_taken_are_given_back(engines):
    import json
    import urllib.request

    a_, b_ = engines
    engine = VLLMRolloutEngine(actor(), VLLMConfig(url=f"{a_.url},{b_.url}"))  # both free when probed
    body = json.dumps({"client": "another:1"}).encode()
    with urllib.request.urlopen(urllib.request.Request(b_.url + "/attach", data=body), timeout=10):
        pass  # another trainer takes b between the probe and the run's start
    with pytest.raises(RolloutEngineError, match=rf"{b_.url} refused /attach.*attached to another trainer"):
        engine.start()
    assert lease_of(a_) is None  # a's lease was given back: a later run may take it
    assert not engine.started


def test_an_engine_that_stops_answering_mid_run_is_named(engines):
    a_, b_ = engines
    a = actor()
    with VLLMRolloutEngine(a, VLLMConfig(url=f"{a_.url},{b_.url}", request_timeout_s=10.0)) as engine:
        engine.generate(request(a, 4))
        b_.close()
        with pytest.raises(RolloutEngineError, match=rf"engine at {b_.url} did not answer /generate"):
            engine.generate(request(a, 4))


def _leader_fails(rank: int, port: int, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    from openaligner.rollout.vllm_engine import _on_leader

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )

    def disk_full() -> None:
        raise OSError(28, "No space left on device")

    try:
        _on_leader(disk_full)
        got = ("", "")
    except Exception as e:
        got = (type(e).__name__, str(e))
    torch.save(got, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_any_failure_of_rank_0s_engine_work_reaches_every_rank_as_an_engine_error(tmp_path):
    """Rank 0 alone talks to the engines; an error of another type than the engine's (a full
    /dev/shm, a store's RuntimeError) once left the other ranks waiting in the next collective."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_leader_fails, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        kind, message = torch.load(tmp_path / f"rank{rank}.pt")
        assert kind == "RolloutEngineError", (rank, kind, message)
        assert "OSError: [Errno 28] No space left on device" in message
