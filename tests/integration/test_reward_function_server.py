"""`openaligner serve-reward reward.function=...` for real: a JSON request as curl sends it, a
tokens request refused naming what to send, and a failing function that fails only its own client's
request while other clients, merged into the same Triton call, get their rewards."""

from __future__ import annotations

import json
import signal
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from procs import Served, free_port

from openaligner.clients.errors import BadRequestError
from openaligner.clients.reward import RemoteGPTRMClient, RemoteRMConfig

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LOGS: dict[str, Served] = {}


@pytest.fixture(scope="module")
def server():
    port = free_port()
    served = Served(
        [
            sys.executable,
            "-m",
            "openaligner",
            "serve-reward",
            f"reward.function={HERE / 'critic_free_rewards.py'}:behave",
            f"server.port={port}",
            "server.max_queue_delay_microseconds=300000",  # hold requests so that they merge
            "server.inference_micro_batch_size=[8]",
            "reward.timeout_s=5",
            "threads=1",
        ]
    )
    served.wait_ready()
    LOGS["server"] = served
    yield port
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(timeout=30)


def post(port: int, body: object, path: str = "/v2/models/reward_model/infer") -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_json_request_with_messages_and_metadata_is_scored(server):
    conversation = [{"role": "user", "content": "sort 3 1 2"}, {"role": "assistant", "content": "1 2 3"}]
    status, answer = post(
        server,
        {
            "inputs": [
                {
                    "name": "messages",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "data": [json.dumps(conversation)],
                },
                {
                    "name": "metadata",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "data": [json.dumps({"answer": "1 2 3"})],
                },
            ]
        },
    )
    assert status == 200, answer
    (rewards,) = [o for o in answer["outputs"] if o["name"] == "rewards"]
    assert rewards["data"] == [5.0]  # len("1 2 3")


def test_tokens_are_refused_naming_messages(server):
    status, answer = post(
        server,
        {
            "inputs": [
                {"name": "tokens", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]},
                {"name": "sequence_lengths", "datatype": "INT64", "shape": [1, 1], "data": [3]},
            ]
        },
    )
    assert status == 400 and "reads 'messages'" in answer["error"], answer


def test_a_raising_function_fails_only_its_own_request(server):
    cfg = RemoteRMConfig(port=server, retries_on_rejected_batch=5)
    results: dict[str, object] = {}

    def ask(name: str, do: str | None) -> None:
        conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": name}]
        with RemoteGPTRMClient(cfg) as client:
            try:
                results[name] = (
                    client.infer_rm_conversations([conversation], metadata=[{"do": do}]).result().tolist()
                )
            except BadRequestError as e:
                results[name] = e

    threads = [
        threading.Thread(target=ask, args=(n, "raise" if n == "bad" else None))
        for n in ("a", "bb", "bad", "ccc")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["a"] == [1.0] and results["bb"] == [2.0] and results["ccc"] == [3.0], results
    assert isinstance(results["bad"], BadRequestError)
    assert "behave raised ValueError: this response cannot be scored" in str(results["bad"])
    # the requests were merged into one call, and the failing one was found alone
    output = LOGS["server"].output
    assert "function failed on 1 of" in output, output[-2000:]
    # and it serves on
    status, _ = post(
        server,
        {
            "inputs": [
                {
                    "name": "messages",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "data": [
                        json.dumps([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}])
                    ],
                }
            ]
        },
    )
    assert status == 200


def test_other_frameworks_formats_reach_the_function_with_their_labels(server):
    """behave scores len(response); a label arrives as metadata["label"] (behave ignores it)."""
    openrlhf = {
        "query": ["Q: 2+2? A: 4", "Q: x A:yz"],
        "prompts": ["Q: 2+2? A:", "Q: x A:"],
        "labels": ["4", "5"],
    }
    status, got = post(server, openrlhf, "/get_reward")
    assert status == 200 and got == {"rewards": [2.0, 2.0], "scores": [2.0, 2.0], "extra_logs": {}}
    slime = {"prompt": [{"role": "user", "content": "q"}], "response": "abc", "label": 1}
    assert post(server, slime, "/remote_rm") == (200, 3.0)
    status, got = post(server, {"model": "fn", "input": "whole text", "use_activation": False}, "/classify")
    assert status == 200 and got["data"][0]["probs"] == [10.0] and got["model"] == "fn"
    # token ids cannot be read by a function: refused in vLLM's error shape, naming what to send
    status, got = post(server, {"input": [5, 6, 7]}, "/classify")
    assert status == 400 and got["error"]["code"] == 400 and "must be text" in got["error"]["message"]
