"""Other frameworks' reward-server wire formats against KServe tokens and the offline forward.

Workload (/work/shared/bench/workload.md): the canonical GPT-2 reward model (n_layer=4, n_embd=256,
n_head=4, vocab 512, n_positions=256, scalar head), random init with seed 0, fp32,
``torch.set_num_threads(2)`` in the server. The reward model's tokenizer is a word-level one
(:func:`~openaligner.models.tokenizers.build_word_tokenizer`) over the words ``w4`` .. ``w511``,
which get the ids 4..511 (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3). A sample is a prompt
of 32 words and a response of 64 words drawn uniformly (seed 0), 128 samples in the pool; the
server lays each out as ``[BOS] + prompt + response + [EOS]``, 98 tokens.

The server (:class:`RewardModelServer` with ``tokenize_func`` and ``render_func``, a real Triton
behind its HTTP front) runs in a child process, as in bench_reward_server.py. For each format, 32
closed-loop clients (threads, one keep-alive ``http.client.HTTPConnection`` each, one sample per
request, the next sent as soon as the last was answered) load it for ``--seconds`` after a 1 s
warm-up:

* ``kserve-tokens``: ``POST /v2/models/reward_model/infer``, ``tokens`` [1, 98] and
  ``sequence_lengths`` [1, 1] (the 98 ids the server would lay out; JSON), the reference;
* ``kserve-messages``: the same route, ``messages`` [1, 1] BYTES holding one JSON conversation
  (the prompt as the user's message, the response as the assistant's);
* ``openrlhf``: ``POST /get_reward`` ``{"query": [prompt + " " + response], "prompts": [prompt],
  "labels": [null]}`` (OpenRLHF sends one sample per request);
* ``remote_rm``: ``POST /remote_rm`` ``{"prompt": prompt, "response": response, "label": null}``
  (slime), answered by a bare number;
* ``classify``: ``POST /classify`` ``{"model": ..., "input": prompt + " " + response,
  "use_activation": false}`` (vLLM/SGLang; verl reads ``data[-1].probs[-1]``).

Every answer's reward is compared with the offline model's for its sample (within 1e-4): once per
format before any load (the run stops if one differs), and during the load (mismatches are
counted and fail the run at the end). Reported per format: requests/s, sequences/s, mean formed
batch (rows per model call, from the server's counters), p50/p99 latency, and the ratio to
``kserve-tokens`` in the same round. The limit is an offline ``RewardModel.infer`` over the same
128 samples laid out exactly as the server lays them out, in one full batch and in micro-batches of
the server's forward size (median of 3 each), measured right before each format because the
shared machine's load drifts. With ``--rounds N`` the formats are measured in turn N times and
each figure is the median over the rounds (every round's figures are printed too).

Prints one JSON object. Usage:
``python benchmarks/bench_reward_formats.py [--seconds 5] [--threads 2] [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench_reward_server import (
    ChildServer,
    against_offline,
    build_model,
    closed_loop,
    free_port,
    serve_until_stopped,
    server_settings,
    versions,
)

POOL = 128
PROMPT_WORDS = 32
RESPONSE_WORDS = 64
CONCURRENCY = 32
MAX_LENGTH = 256
TOLERANCE = 1e-4
MODEL = "reward_model"
WORDS = [f"w{i}" for i in range(4, 512)]
"""The tokenizer's ordinary words: ``w<i>`` gets id ``i`` (after the four special tokens)."""


def tokenizer() -> Any:
    from openaligner.models.tokenizers import build_word_tokenizer

    tok = build_word_tokenizer(WORDS)
    ids = tok.convert_tokens_to_ids(["w4", "w511"])
    assert ids == [4, 511] and tok.bos_token_id == 2 and tok.eos_token_id == 1, ids
    return tok


def samples() -> list[tuple[str, str]]:
    """The fixed pool of ``(prompt, response)`` texts (seed 0)."""
    ids = torch.randint(
        4, 512, (POOL, PROMPT_WORDS + RESPONSE_WORDS), generator=torch.Generator().manual_seed(0)
    )
    rows = [[f"w{int(i)}" for i in row] for row in ids]
    return [(" ".join(r[:PROMPT_WORDS]), " ".join(r[PROMPT_WORDS:])) for r in rows]


def conversation(prompt: str, response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def laid_out(pool: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` [POOL, 98] and ``lengths`` [POOL] as the server lays the samples out — rendered as
    conversations (``messages``, OpenRLHF, remote_rm) and tokenized as whole texts (``classify``),
    which must agree."""
    from openaligner.servers.reward import make_render_func, make_tokenize_func

    tok = tokenizer()
    tokens, lengths = make_render_func(tok)([conversation(p, r) for p, r in pool], MAX_LENGTH)
    whole, whole_lengths = make_tokenize_func(tok, max_length=MAX_LENGTH)([f"{p} {r}" for p, r in pool])
    assert torch.equal(tokens, whole) and torch.equal(lengths, whole_lengths), "layouts differ"
    assert bool((lengths == PROMPT_WORDS + RESPONSE_WORDS + 2).all()), lengths
    return tokens, lengths


def serve(conn: Connection, port: int, threads: int, server_kwargs: dict[str, Any]) -> None:
    """Child process: build the model and its tokenizer, serve them, answer 'stats' and 'stop'."""
    os.dup2(2, 1)  # tritonserver inherits stdout and prints to it; keep the parent's JSON clean
    torch.set_num_threads(threads)
    from openaligner.servers.reward import (
        RewardEndpoint,
        RewardModelServer,
        make_render_func,
        make_tokenize_func,
    )

    model = build_model()
    tok = tokenizer()
    server = RewardModelServer(
        infer_fn=model.infer,
        tokenize_func=make_tokenize_func(tok, max_length=MAX_LENGTH),
        render_func=make_render_func(tok),
        port=port,
        vocab_size=512,
        max_sequence_length=MAX_LENGTH,
        **server_kwargs,
    )
    endpoint = server.endpoint
    assert isinstance(endpoint, RewardEndpoint)  # no reward function: the model's endpoint
    serve_until_stopped(conn, server, lambda: asdict(endpoint.stats))


# ----------------------------------------------------------------------------- the formats
@dataclass(frozen=True)
class Format:
    """One wire format: where it is posted, each sample's request body, how to read the reward."""

    name: str
    path: str
    bodies: list[bytes]
    reward: Callable[[Any], float]


def _kserve_reward(answer: Any) -> float:
    (output,) = [o for o in answer["outputs"] if o["name"] == "rewards"]
    return float(output["data"][0])


def formats(pool: list[tuple[str, str]], tokens: torch.Tensor, lengths: torch.Tensor) -> list[Format]:
    infer = f"/v2/models/{MODEL}/infer"

    def kserve(inputs: list[dict[str, Any]]) -> bytes:
        return json.dumps({"inputs": inputs}).encode()

    token_bodies = [
        kserve(
            [
                {"name": "tokens", "shape": [1, int(n)], "datatype": "INT64", "data": row[: int(n)].tolist()},
                {"name": "sequence_lengths", "shape": [1, 1], "datatype": "INT64", "data": [int(n)]},
            ]
        )
        for row, n in zip(tokens, lengths, strict=True)
    ]
    message_bodies = [
        kserve(
            [
                {
                    "name": "messages",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "data": [json.dumps(conversation(p, r))],
                }
            ]
        )
        for p, r in pool
    ]
    openrlhf = [
        json.dumps({"query": [f"{p} {r}"], "prompts": [p], "labels": [None]}).encode() for p, r in pool
    ]
    remote_rm = [json.dumps({"prompt": p, "response": r, "label": None}).encode() for p, r in pool]
    classify = [
        json.dumps({"model": MODEL, "input": f"{p} {r}", "use_activation": False}).encode() for p, r in pool
    ]
    return [
        Format("kserve-tokens", infer, token_bodies, _kserve_reward),
        Format("kserve-messages", infer, message_bodies, _kserve_reward),
        Format("openrlhf", "/get_reward", openrlhf, lambda a: float(a["rewards"][0])),
        Format("remote_rm", "/remote_rm", remote_rm, float),
        Format("classify", "/classify", classify, lambda a: float(a["data"][-1]["probs"][-1])),
    ]


HEADERS = {"Content-Type": "application/json"}


def post(conn: http.client.HTTPConnection, fmt: Format, index: int) -> float:
    """One request on a keep-alive connection; the reward it answered."""
    conn.request("POST", fmt.path, body=fmt.bodies[index], headers=HEADERS)
    response = conn.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"{fmt.name}: HTTP {response.status}: {payload[:500]!r}")
    return fmt.reward(json.loads(payload))


def check_answers(port: int, fmt: Format, expected: list[float], indices: range) -> None:
    """Fail loudly unless ``fmt`` answers each sample's offline reward within TOLERANCE."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        for i in indices:
            got = post(conn, fmt, i)
            if not math.isfinite(got) or abs(got - expected[i]) > TOLERANCE:
                raise SystemExit(
                    f"{fmt.name}: sample {i} got reward {got!r}, the offline model gives {expected[i]!r} "
                    f"(tolerance {TOLERANCE})"
                )
    finally:
        conn.close()


def load(port: int, fmt: Format, expected: list[float], seconds: float) -> dict[str, Any]:
    """CONCURRENCY closed-loop clients; latencies of requests that started after the warm-up."""
    mismatches = [0]
    lock = threading.Lock()

    def request(conn: http.client.HTTPConnection, k: int) -> None:
        index = k % POOL
        if abs(post(conn, fmt, index) - expected[index]) > TOLERANCE:
            with lock:
                mismatches[0] += 1

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    try:
        result = closed_loop(CONCURRENCY, seconds, connect, request)
    except RuntimeError as e:
        raise RuntimeError(f"{fmt.name}: {e}") from None
    return {
        "format": fmt.name,
        "path": fmt.path,
        **result,
        "sequences_per_s": result["requests_per_s"],
        "reward_mismatches": mismatches[0],
    }


def offline_sequences_per_s(
    model: Any, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int | None
) -> float:
    model.infer(tokens[:8], lengths[:8])  # warm-up
    times = []
    for _ in range(3):
        started = time.perf_counter()
        model.infer(tokens, lengths, micro_batch_size=micro_batch_size)
        times.append(time.perf_counter() - started)
    return tokens.shape[0] / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--seconds", type=float, default=5.0, help="measured seconds per format")
    add("--threads", type=int, default=2, help="torch threads, here and in the server")
    add("--forward-micro-batch", type=int, default=32, help="server model_forward_micro_batch_size")
    add("--preferred", type=int, nargs="+", default=[32], help="server inference_micro_batch_size")
    add("--queue-delay-us", type=int, default=2000, help="server max_queue_delay_microseconds")
    add("--rounds", type=int, default=1, help="times each format is measured (medians reported)")
    add("--formats", nargs="+", default=None, help="formats to measure (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    pool = samples()
    tokens, lengths = laid_out(pool)
    model = build_model()
    expected = [float(model.infer(tokens[i : i + 1], lengths[i : i + 1])) for i in range(POOL)]
    chosen = formats(pool, tokens, lengths)
    if args.formats is not None:
        unknown = set(args.formats) - {f.name for f in chosen}
        if unknown:
            parser.error(f"unknown formats {sorted(unknown)}; choose from {[f.name for f in chosen]}")
        chosen = [f for f in chosen if f.name in args.formats]

    server_kwargs = server_settings(args)
    port = free_port()
    server = ChildServer(serve, port, args.threads, server_kwargs)

    rounds: list[list[dict[str, Any]]] = []
    try:
        for fmt in chosen:
            check_answers(port, fmt, expected, range(4))
        for _ in range(args.rounds):
            measured = []
            for fmt in chosen:
                offline_full = offline_sequences_per_s(model, tokens, lengths, None)
                offline_mbs = offline_sequences_per_s(model, tokens, lengths, args.forward_micro_batch)
                before = server.stats()
                result = load(port, fmt, expected, args.seconds)
                after = server.stats()
                against_offline(result, before, after, offline_full, offline_mbs)
                result["load_average_1min_after"] = os.getloadavg()[0]
                measured.append(result)
            reference = next((r for r in measured if r["format"] == "kserve-tokens"), None)
            for r in measured:
                if reference is not None:
                    r["ratio_to_kserve_tokens"] = r["sequences_per_s"] / reference["sequences_per_s"]
            rounds.append(measured)
    finally:
        stop_s = server.stop()

    results = [medians([measured[i] for measured in rounds]) for i in range(len(chosen))]
    print(
        json.dumps(
            {
                "benchmark": "reward_formats",
                "workload": (
                    "GPT-2 n_layer=4 n_embd=256 n_head=4 vocab=512, scalar head; word tokenizer w4..w511; "
                    f"samples of {PROMPT_WORDS}-word prompt + {RESPONSE_WORDS}-word response "
                    f"({PROMPT_WORDS + RESPONSE_WORDS + 2} tokens with BOS/EOS), {CONCURRENCY} clients, "
                    "one sample per request"
                ),
                "threads": args.threads,
                "seconds": args.seconds,
                "server": server_kwargs,
                "rounds": args.rounds,
                "formats": results,
                "startup_s": server.start_s,
                "process_ready_s": server.ready_s,
                "shutdown_s": stop_s,
                "load_average_before": list(load_before),
                "load_average_after": list(os.getloadavg()),
                "versions": {
                    **versions(),
                    "tokenizers": _version("tokenizers"),
                    "aiohttp": _version("aiohttp"),
                },
            },
            indent=2,
        )
    )
    mismatched = {r["format"]: r["reward_mismatches"] for r in results if r["reward_mismatches"]}
    if mismatched:
        raise SystemExit(f"rewards differing from the offline model's during the load: {mismatched}")


def medians(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """One format's figures: the median over rounds of each number, and every round's figures."""
    out: dict[str, Any] = {}
    for key, value in per_round[0].items():
        values = [r[key] for r in per_round]
        numbers = isinstance(value, int | float) and not isinstance(value, bool)
        out[key] = statistics.median(values) if numbers and len(set(values)) > 1 else value
    out["reward_mismatches"] = sum(r["reward_mismatches"] for r in per_round)
    if len(per_round) > 1:
        out["per_round"] = per_round
    return out


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
