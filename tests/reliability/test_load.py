"""Sustained load on the deployed servers: 32 concurrent clients on each of reward_model and
critic_infer, every answer checked, resident memory measured after a warm-up.

The servers are ``openaligner serve-reward`` and ``serve-critic`` subprocesses (tiny models, one
torch thread each); the clients are ``tritonclient.http`` connections in threads of this process,
each sending its next request as soon as the last is answered, with 1-4 rows padded to 32 tokens
so that Triton merges them. Each answer must equal, within float tolerance, the one the same
server gave for the same request alone before the load: merged batches must neither fail nor mix
rows. Memory is the resident set (VmRSS) of the server process, and of its whole process tree
(tritonserver and its python-backend stubs included).

Then well-formed and hostile clients together: 16 well-formed clients per server (12
``tritonclient`` connections and 4 of the project's own clients) next to 4 hostile ones sending
hand-written bad requests — most shaped exactly like the good ones, so that Triton would merge
them — and resource hogs. No well-formed request may fail or get another answer than alone, and
every hostile one must get its 4xx, never a 5xx or a traceback. Beside them on the reward server,
clients of other frameworks' wire formats (OpenRLHF's /get_reward, slime's /remote_rm, verl's
/classify: one sample per request, as those trainers send) must get each sample's reward alone,
and hostile requests in those formats join the hostile mix.

``test_load_short`` and ``test_mixed_..._short`` (a few seconds each) run in every test run;
``test_load_soak`` runs for ``$OPENALIGNER_LOAD_SECONDS`` (default 60) and
``test_mixed_..._soak`` for 20 s with ``-m reliability`` / ``-m soak`` (see conftest.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton_http
from support import Memory

pytestmark = pytest.mark.reliability

CLIENTS = 32  # concurrent clients per endpoint
WIDTH = 32  # tokens per row (the clients' pad_to_length)
DISTINCT = 8  # distinct requests per endpoint; client i sends requests i and i+1 (mod DISTINCT) in turn
MAX_RSS_GROWTH = 0.10
SHORT_S, SHORT_WARMUP_S = 6.0, 4.0
SOAK_WARMUP_S = 10.0
MODELS = {"reward_model": ("rewards",), "critic_infer": ("values", "rewards")}


@dataclass
class LoadResult:
    """What a load run saw."""

    seconds: float
    answered: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    after_warmup: dict[str, Memory] = field(default_factory=dict)
    at_end: dict[str, Memory] = field(default_factory=dict)
    peak: dict[str, Memory] = field(default_factory=dict)

    def growth(self, name: str) -> tuple[float, float]:
        """Relative RSS growth from the end of warm-up to the end: (server process, process tree)."""
        a, b = self.after_warmup[name], self.at_end[name]
        return (b.server_kb - a.server_kb) / a.server_kb, (b.tree_kb - a.tree_kb) / a.tree_kb

    def summary(self) -> str:
        parts = [f"{self.seconds:.0f} s measured"]
        for name in self.after_warmup:
            server, tree = self.growth(name)
            parts.append(
                f"{name}: {self.answered[name]} answers ({self.answered[name] / self.seconds:.0f}/s), RSS "
                f"{self.after_warmup[name].server_kb // 1024} -> {self.at_end[name].server_kb // 1024} MB "
                f"({server:+.1%}), tree {self.after_warmup[name].tree_kb // 1024} -> "
                f"{self.at_end[name].tree_kb // 1024} MB ({tree:+.1%}), peak tree "
                f"{self.peak[name].tree_kb // 1024} MB"
            )
        return "; ".join(parts)


def requests_for(model: str) -> list[tuple[list[triton_http.InferInput], int]]:
    """``DISTINCT`` requests of 1-4 rows, right-padded to ``WIDTH``, with their row counts."""
    rng = np.random.default_rng(0 if model == "reward_model" else 1)
    out = []
    for i in range(DISTINCT):
        rows = 1 + i % 4
        lengths = rng.integers(1, WIDTH + 1, (rows, 1)).astype(np.int64)
        tokens = rng.integers(3, 100, (rows, WIDTH)).astype(np.int64)
        tokens[np.arange(WIDTH)[None, :] >= lengths] = 0
        t = triton_http.InferInput("tokens", [rows, WIDTH], "INT64")
        t.set_data_from_numpy(tokens, binary_data=True)
        n = triton_http.InferInput("sequence_lengths", [rows, 1], "INT64")
        n.set_data_from_numpy(lengths, binary_data=True)
        out.append(([t, n], rows))
    return out


def answer(client: triton_http.InferenceServerClient, model: str, inputs: list) -> dict[str, np.ndarray]:
    result = client.infer(model, inputs)
    return {name: result.as_numpy(name) for name in MODELS[model]}


def run_load(ports: dict[str, int], pids: dict[str, int], seconds: float, warmup_s: float) -> LoadResult:
    """``CLIENTS`` closed-loop clients per model for ``warmup_s + seconds``; memory sampled every
    second after the warm-up."""
    requests = {model: requests_for(model) for model in ports}
    reference: dict[str, list[dict[str, np.ndarray]]] = {}
    for model, port in ports.items():  # each request alone, before the load
        client = triton_http.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
        reference[model] = [answer(client, model, inputs) for inputs, _ in requests[model]]
        client.close()

    result = LoadResult(seconds)
    stop = threading.Event()
    lock = threading.Lock()

    def client_loop(model: str, index: int) -> None:
        client = triton_http.InferenceServerClient(
            f"127.0.0.1:{ports[model]}", connection_timeout=60, network_timeout=60
        )
        mine = [index % DISTINCT, (index + 1) % DISTINCT]
        sent = 0
        try:
            while not stop.is_set():
                which = mine[sent % 2]
                sent += 1
                try:
                    got = answer(client, model, requests[model][which][0])
                    for name, want in reference[model][which].items():
                        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4, err_msg=name)
                except Exception as e:  # every failure is counted, none ends the run
                    with lock:
                        result.errors.append(f"{model} client {index}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                with lock:
                    result.answered[model] += 1
        finally:
            client.close()

    threads = [
        threading.Thread(target=client_loop, args=(model, i), daemon=True)
        for model in ports
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    with lock:
        result.answered.clear()
    result.after_warmup = {m: Memory.of(pid) for m, pid in pids.items()}
    result.peak = dict(result.after_warmup)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(1.0, left))
        for m, pid in pids.items():
            now = Memory.of(pid)
            if now.tree_kb > result.peak[m].tree_kb:
                result.peak[m] = now
    result.at_end = {m: Memory.of(pid) for m, pid in pids.items()}
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    return result


def check(result: LoadResult, min_answers: int) -> None:
    print(result.summary())
    assert not result.errors, f"{len(result.errors)} errors, e.g. {result.errors[:3]}"
    for model in MODELS:
        assert result.answered[model] >= min_answers, result.summary()
        server, tree = result.growth(model)
        assert server < MAX_RSS_GROWTH and tree < MAX_RSS_GROWTH, result.summary()


def _targets(cli_servers) -> tuple[dict[str, int], dict[str, int]]:
    ports = {"reward_model": cli_servers.reward_port, "critic_infer": cli_servers.critic_port}
    pids = {"reward_model": cli_servers.reward.proc.pid, "critic_infer": cli_servers.critic.proc.pid}
    return ports, pids


def test_load_short_no_errors_and_bounded_memory(cli_servers):
    ports, pids = _targets(cli_servers)
    check(run_load(ports, pids, SHORT_S, SHORT_WARMUP_S), min_answers=100)


@pytest.mark.soak
def test_load_soak_no_errors_and_bounded_memory(cli_servers):
    seconds = float(os.environ.get("OPENALIGNER_LOAD_SECONDS", "60"))
    ports, pids = _targets(cli_servers)
    check(run_load(ports, pids, seconds, SOAK_WARMUP_S), min_answers=int(20 * seconds))


# ---------------------------------------------------------------------------- good and hostile clients
GOOD_CLIENTS = 16  # per server: 12 tritonclient connections and 4 of the project's own clients
OWN_CLIENTS = 4
HOSTILE_CLIENTS = 4  # per server
FOREIGN_FORMATS = ("OpenRLHF", "slime", "verl")  # good clients of other wire formats, one each, reward only
OPENRLHF, REMOTE_RM, CLASSIFY = "/get_reward", "/remote_rm", "/classify"


def _foreign_samples() -> list[tuple[str, str, str]]:
    """``DISTINCT`` (prompt, response, label) samples of assorted lengths."""
    rng = np.random.default_rng(5)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789?:.,!"))
    return [
        (
            "Q: " + "".join(rng.choice(letters, rng.integers(2, 40))) + "? A:",
            " " + "".join(rng.choice(letters, rng.integers(1, 40))),
            str(i),
        )
        for i in range(DISTINCT)
    ]


FOREIGN_SAMPLES = _foreign_samples()


def foreign_request(fmt: str, sample: tuple[str, str, str]) -> tuple[str, bytes]:
    """One sample as ``fmt``'s trainer sends it: OpenRLHF's remote RM (query = prompt + response),
    slime's remote_rm, verl's vLLM classify call (the raw reward: use_activation false)."""
    prompt, response, label = sample
    if fmt == "OpenRLHF":
        return OPENRLHF, json.dumps(
            {"query": [prompt + response], "prompts": [prompt], "labels": [label]}
        ).encode()
    if fmt == "slime":
        return REMOTE_RM, json.dumps({"prompt": prompt, "response": response, "label": label}).encode()
    doc = {"model": "reward_model", "input": prompt + response, "use_activation": False}
    return CLASSIFY, json.dumps(doc).encode()


def foreign_reward(fmt: str, port: int, sample: tuple[str, str, str]) -> float:
    """The reward the server answers for ``sample`` in ``fmt``."""
    from support import post

    path, body = foreign_request(fmt, sample)
    got = post(port, path, body)
    assert got.status == 200, f"{fmt}: {got.status} {got.body[:300]!r}"
    doc = json.loads(got.body)
    if fmt == "OpenRLHF":
        assert doc["rewards"] == doc["scores"] and len(doc["rewards"]) == 1, doc
        return float(doc["rewards"][0])
    if fmt == "slime":
        assert isinstance(doc, float), doc
        return doc
    assert len(doc["data"]) == 1, doc
    return float(doc["data"][0]["probs"][0])


MIXED_SHORT_S = 5.0
MIXED_SOAK_S = 20.0
MIXED_MODELS = {"reward_model": "reward model", "critic_infer": "critic"}
MIXED_WARMUP_FRACTION = 0.4  # RSS growth is measured over the rest of the run


@dataclass(frozen=True)
class Hostile:
    """One hostile request, raw, and the status class it must get (4 = refused, 2 = answered)."""

    what: str
    body: bytes
    headers: dict[str, str]
    status_class: int = 4
    path: str | None = None  # another wire format's route, on the reward server only (None: infer)
    method: str = "POST"


def _raw_json(*items: str, extra: str = "") -> bytes:
    return ('{"inputs": [' + ", ".join(items) + "]" + extra + "}").encode()


def hostile_requests() -> list[Hostile]:
    """Protocol abuse, parser differences, content errors and resource exhaustion. Most are shaped
    as the good clients' requests ([rows, WIDTH] INT64 tokens), so that Triton would merge them
    with good ones if they ever reached it."""
    from support import binary_body

    rng = np.random.default_rng(7)
    tokens = rng.integers(3, 100, (2, WIDTH)).astype(np.int64)
    lengths = np.array([[WIDTH], [5]], np.int64)

    def with_(
        tokens_: np.ndarray = tokens, lengths_: np.ndarray | None = lengths, **extra: np.ndarray
    ) -> tuple:
        arrays = {
            "tokens": tokens_,
            **({"sequence_lengths": lengths_} if lengths_ is not None else {}),
            **extra,
        }
        return binary_body(arrays)

    zero, over, outside = lengths.copy(), lengths.copy(), tokens.copy()
    zero[1, 0], over[1, 0], outside[0, 3] = 0, WIDTH + 1, 100
    data = ", ".join(str(int(t)) for t in tokens[0])
    good_tokens = f'{{"name": "tokens", "datatype": "INT64", "shape": [1, {WIDTH}], "data": [{data}]}}'
    good_lengths = '{"name": "sequence_lengths", "datatype": "INT64", "shape": [1, 1], "data": [3]}'
    huge = good_tokens.replace(f"[1, {WIDTH}]", "[1, 1000000000000]")
    texts = np.array([[b"ok"], [b"\xff\xfe"]], dtype=object)
    return [
        Hostile("length 0", *with_(lengths_=zero)),
        Hostile("length over the width", *with_(lengths_=over)),
        Hostile("id outside the vocabulary", *with_(tokens_=outside)),
        Hostile("tokens without lengths", *with_(lengths_=None)),
        Hostile("tokens as INT32", *with_(tokens_=tokens.astype(np.int32))),
        Hostile(
            "a huge shape given first, a small one second",
            _raw_json(
                good_tokens.replace('"shape"', '"shape": [1, 1000000000000], "shape"', 1), good_lengths
            ),
            {},
        ),
        Hostile(
            "a huge input given first, a good one second",
            _raw_json(huge, extra=f', "inputs": [{good_tokens}, {good_lengths}]'),
            {},
        ),
        Hostile("NaN as a length", _raw_json(good_tokens, good_lengths.replace("[3]", "[NaN]")), {}),
        Hostile(
            "a 4301-digit id",
            _raw_json(good_tokens.replace("[" + data[:1], "[" + "9" * 4301 + data[:1], 1), good_lengths),
            {},
        ),
        Hostile("a shape lying about its data", _raw_json(huge, good_lengths), {}),
        Hostile("text not UTF-8", *binary_body({"sentences": texts})),
        Hostile("garbage", b"\x00\xff" * 64, {}),
        Hostile("gzip body", b"\x1f\x8b" + b"\x00" * 30, {"Content-Encoding": "gzip"}),
        Hostile(
            "rows over max_batch_size", *with_(np.zeros((1025, 2), np.int64), np.ones((1025, 1), np.int64))
        ),
        Hostile("a 2 MB text", *binary_body({"sentences": np.array([[b"a" * 2**21]], dtype=object)}), 2),
        *foreign_hostile_requests(),
    ]


def foreign_hostile_requests() -> list[Hostile]:
    """Hostile requests in the other wire formats, most of them one sample like the good foreign
    clients' (so that Triton would merge them with good ones if they ever reached it)."""
    import gzip

    sample = FOREIGN_SAMPLES[0]
    query, prompt, response = sample[0] + sample[1], sample[0], sample[1]
    openrlhf = json.dumps({"query": [query], "prompts": [prompt]})
    return [
        Hostile("OpenRLHF: NaN label", (openrlhf[:-1] + ', "labels": [NaN]}').encode(), {}, path=OPENRLHF),
        Hostile(
            "OpenRLHF: 'query' twice, 1025 rows first",
            ('{"query": ' + json.dumps([query] * 1025) + ", " + openrlhf[1:]).encode(),
            {},
            path=OPENRLHF,
        ),
        Hostile(
            "OpenRLHF: rows over max_batch_size",
            json.dumps({"query": ["a"] * 1025}).encode(),
            {},
            path=OPENRLHF,
        ),
        Hostile(
            "OpenRLHF: 'labels' one short",
            json.dumps({"query": [query, query], "prompts": [prompt, prompt], "labels": ["4"]}).encode(),
            {},
            path=OPENRLHF,
        ),
        Hostile(
            "remote_rm: 'response' a number",
            json.dumps({"prompt": prompt, "response": 4}).encode(),
            {},
            path=REMOTE_RM,
        ),
        Hostile(
            "remote_rm: lone surrogate",
            (json.dumps({"prompt": prompt, "response": response})[:-2] + '\\udc00"}').encode(),
            {},
            path=REMOTE_RM,
        ),
        Hostile(
            "remote_rm: gzip body",
            gzip.compress(json.dumps({"prompt": prompt, "response": response}).encode()),
            {"Content-Encoding": "gzip"},
            path=REMOTE_RM,
        ),
        Hostile("classify: id outside the vocabulary", b'{"input": [5, 600, 7]}', {}, path=CLASSIFY),
        Hostile(
            "classify: ids over the position limit",
            json.dumps({"input": [5] * 4097}).encode(),
            {},
            path=CLASSIFY,
        ),
        Hostile(
            "classify: a 5000-digit id", ('{"input": [[5, ' + "9" * 5000 + "]]}").encode(), {}, path=CLASSIFY
        ),
        Hostile("classify: empty text", b'{"input": "", "use_activation": false}', {}, path=CLASSIFY),
        Hostile("classify: GET", b"", {}, path=CLASSIFY, method="GET"),
        Hostile("classify: a 2 MB text", json.dumps({"input": "a" * 2**21}).encode(), {}, 2, path=CLASSIFY),
    ]


@dataclass
class MixedResult:
    """What a run of good and hostile clients saw, per model."""

    seconds: float
    good: Counter[str] = field(default_factory=Counter)
    good_failures: dict[str, list[str]] = field(default_factory=dict)
    hostile: Counter[str] = field(default_factory=Counter)
    hostile_violations: list[str] = field(default_factory=list)
    foreign: Counter[str] = field(default_factory=Counter)  # good foreign-format answers, per format
    at_start: dict[str, Memory] = field(default_factory=dict)
    at_end: dict[str, Memory] = field(default_factory=dict)

    def growth(self, model: str) -> float:
        """Relative RSS growth of the server's process tree from the end of the warm-up to the end."""
        return (self.at_end[model].tree_kb - self.at_start[model].tree_kb) / self.at_start[model].tree_kb

    def summary(self) -> str:
        parts = [f"{self.seconds:.0f} s"]
        for model in MIXED_MODELS:
            failed = len(self.good_failures.get(model, []))
            total = self.good[model] + failed
            parts.append(
                f"{model}: {total} good requests, {failed} failed ({failed / max(total, 1):.1%}), "
                f"{self.hostile[model]} hostile answered"
            )
            if model in self.at_start:
                parts[-1] += (
                    f", tree RSS {self.at_start[model].tree_kb // 1024} -> "
                    f"{self.at_end[model].tree_kb // 1024} MB ({self.growth(model):+.1%})"
                )
        if self.foreign:
            parts.append(
                "foreign formats: " + ", ".join(f"{f} {n} answered" for f, n in self.foreign.items())
            )
        return "; ".join(parts)


def _own_client(model: str, port: int) -> Any:
    from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient
    from openaligner.clients.reward import RemoteGPTRMClient, RemoteRMConfig

    if model == "reward_model":
        return RemoteGPTRMClient(
            RemoteRMConfig(port=port, pad_to_length=WIDTH, max_workers=1, init_timeout_s=60)
        )
    cfg = RemoteCriticConfig(
        pad_to_length=WIDTH, critic=CriticAddress(port=port), max_workers=1, init_timeout_s=60
    )
    return RemoteGPTRMCriticClient(cfg)


def _own_request(client: Any, model: str, batch: dict[str, Any]) -> dict[str, np.ndarray]:
    if model == "reward_model":
        return {"rewards": client.infer_rm(batch).result().numpy()}
    rewards, values = client.infer_rm_critic(batch).result()
    return {"rewards": rewards.numpy(), "values": values.numpy()}


def _own_batches(model: str) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(3 if model == "reward_model" else 4)
    out = []
    for i in range(DISTINCT):
        rows = 1 + i % 4
        out.append(
            {
                "response_tokens": torch.randint(3, 100, (rows, WIDTH), generator=g),
                "response_lengths": torch.randint(2, WIDTH + 1, (rows,), generator=g),
            }
        )
    return out


def run_mixed(
    ports: dict[str, int], seconds: float, hostile: list[Hostile], pids: dict[str, int] | None = None
) -> MixedResult:
    """``GOOD_CLIENTS`` closed-loop well-formed clients and ``HOSTILE_CLIENTS`` hostile ones per
    model for ``seconds``, and on the reward server one good client per foreign format; every good
    answer is compared with the same request's answer alone. Hostile requests on a foreign route go
    to the reward server only. The RSS of ``pids`` (model -> server pid) is taken after the first
    ``MIXED_WARMUP_FRACTION`` of the run and at its end."""
    tritonclient_requests = {model: requests_for(model) for model in ports}
    own_batches = {model: _own_batches(model) for model in ports}
    reference: dict[str, list[dict[str, np.ndarray]]] = {}
    own_reference: dict[str, list[dict[str, np.ndarray]]] = {}
    for model, port in ports.items():  # each request alone, before the load
        client = triton_http.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
        reference[model] = [answer(client, model, inputs) for inputs, _ in tritonclient_requests[model]]
        client.close()
        with _own_client(model, port) as own:
            own_reference[model] = [_own_request(own, model, b) for b in own_batches[model]]
    foreign_port = ports.get("reward_model")
    foreign_reference = {
        fmt: [foreign_reward(fmt, foreign_port, sample) for sample in FOREIGN_SAMPLES]
        for fmt in (FOREIGN_FORMATS if foreign_port is not None else ())
    }

    result = MixedResult(seconds)
    result.good_failures = {model: [] for model in ports}
    stop = threading.Event()
    lock = threading.Lock()

    def good_loop(model: str, index: int) -> None:
        own = index < OWN_CLIENTS
        client = (
            _own_client(model, ports[model])
            if own
            else triton_http.InferenceServerClient(
                f"127.0.0.1:{ports[model]}", connection_timeout=60, network_timeout=60
            )
        )
        sent = 0
        try:
            while not stop.is_set():
                which = (index + sent) % DISTINCT
                sent += 1
                try:
                    if own:
                        got, want = (
                            _own_request(client, model, own_batches[model][which]),
                            own_reference[model][which],
                        )
                    else:
                        got = answer(client, model, tritonclient_requests[model][which][0])
                        want = reference[model][which]
                    for name, expected in want.items():
                        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-4, err_msg=name)
                except Exception as e:  # every failure is counted, none ends the run
                    with lock:
                        kind = "own client" if own else "tritonclient"
                        result.good_failures[model].append(
                            f"{kind} {index}: {type(e).__name__}: {str(e)[:300]}"
                        )
                    continue
                with lock:
                    result.good[model] += 1
        finally:
            client.close()

    def foreign_loop(fmt: str, index: int) -> None:
        assert foreign_port is not None
        sent = 0
        while not stop.is_set():
            which = (index + sent) % DISTINCT
            sent += 1
            try:
                got = foreign_reward(fmt, foreign_port, FOREIGN_SAMPLES[which])
                np.testing.assert_allclose(got, foreign_reference[fmt][which], rtol=1e-4, atol=1e-4)
            except Exception as e:  # every failure is counted, none ends the run
                with lock:
                    result.good_failures["reward_model"].append(
                        f"{fmt} client: {type(e).__name__}: {str(e)[:300]}"
                    )
                continue
            with lock:
                result.foreign[fmt] += 1

    def hostile_loop(model: str, index: int) -> None:
        mine = [h for h in hostile if h.path is None or model == "reward_model"]
        sent = 0
        while not stop.is_set():
            h = mine[(index + sent) % len(mine)]
            sent += 1
            try:
                got = _send(ports[model], h.method, h.path or f"/v2/models/{model}/infer", h.body, h.headers)
            except OSError as e:
                with lock:
                    result.hostile_violations.append(f"{model} {h.what}: {type(e).__name__}: {e}")
                continue
            with lock:
                result.hostile[model] += 1
                if got.status // 100 != h.status_class or b"Traceback" in got.body:
                    result.hostile_violations.append(f"{model} {h.what}: {got.status} {got.body[:200]!r}")
                elif h.path is not None and got.status >= 400 and "error" not in json.loads(got.body):
                    result.hostile_violations.append(
                        f"{model} {h.what}: not an error body: {got.body[:200]!r}"
                    )

    threads = [
        threading.Thread(target=loop, args=(model, i), daemon=True)
        for model in ports
        for loop, count in ((good_loop, GOOD_CLIENTS), (hostile_loop, HOSTILE_CLIENTS))
        for i in range(count)
    ]
    threads += [
        threading.Thread(target=foreign_loop, args=(fmt, i), daemon=True)
        for i, fmt in enumerate(foreign_reference)
    ]
    for t in threads:
        t.start()
    time.sleep(MIXED_WARMUP_FRACTION * seconds)  # the first large requests set the high-water marks
    result.at_start = {m: Memory.of(pid) for m, pid in (pids or {}).items()}
    time.sleep((1 - MIXED_WARMUP_FRACTION) * seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    result.at_end = {m: Memory.of(pid) for m, pid in (pids or {}).items()}
    return result


def _send(port: int, method: str, path: str, body: bytes, headers: dict[str, str]) -> Any:
    """``method path`` to ``127.0.0.1:port`` (no body when ``body`` is empty)."""
    import http.client

    from support import Answer

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60.0)
    try:
        conn.request(method, path, body=body or None, headers={"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return Answer(response.status, response.read())
    finally:
        conn.close()


def check_mixed(result: MixedResult, ports: dict[str, int]) -> None:
    print(result.summary())
    failures = [f for fs in result.good_failures.values() for f in fs]
    assert not failures, (
        f"{len(failures)} well-formed requests failed ({result.summary()}), e.g. {failures[:3]}"
    )
    assert not result.hostile_violations, result.hostile_violations[:5]
    for model in ports:
        assert result.good[model] >= 20 and result.hostile[model] >= 10, result.summary()
    if "reward_model" in ports:
        assert all(result.foreign[fmt] >= 5 for fmt in FOREIGN_FORMATS), result.summary()
    for model in result.at_start:
        assert result.growth(model) < MAX_RSS_GROWTH, result.summary()


def test_mixed_good_and_hostile_clients_short(cli_servers):
    ports, pids = _targets(cli_servers)
    check_mixed(run_mixed(ports, MIXED_SHORT_S, hostile_requests(), pids), ports)


@pytest.mark.soak
def test_mixed_good_and_hostile_clients_soak(cli_servers):
    ports, pids = _targets(cli_servers)
    check_mixed(run_mixed(ports, MIXED_SOAK_S, hostile_requests(), pids), ports)
