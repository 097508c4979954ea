"""`openaligner serve-reward reward.function=...` for real: a JSON request as curl sends it, a
tokens request refused naming what to send, and function calls that raise, kill their worker or hang
failing only their own client's request while plain KServe clients beside them, merged into the same
Triton call, get their rewards without delay."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
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
            "reward.timeout_s=3",
            "reward.workers=3",
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
    # the failing call was refused at the front, alone: no valid request was rejected with it
    output = LOGS["server"].output
    assert "reward_model: " in output and "Triton merged" not in output, output[-2000:]
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


def scored(response: str, do: str | None = None) -> dict[str, Any]:
    """A plain KServe v2 request (as curl or tritonclient send it) for one conversation."""
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]
    return {
        "inputs": [
            {"name": "messages", "datatype": "BYTES", "shape": [1, 1], "data": [json.dumps(conversation)]},
            {"name": "metadata", "datatype": "BYTES", "shape": [1, 1], "data": [json.dumps({"do": do})]},
        ]
    }


def rewards_of(answer: Any) -> list[float]:
    (rewards,) = [o for o in answer["outputs"] if o["name"] == "rewards"]
    return list(rewards["data"])


def merged_round(port: int, good: list[str], hostile: list[str]) -> dict[str, tuple[int, Any]]:
    """Every request at once (Triton's 300 ms queue delay merges them): name → (status, answer)."""
    results: dict[str, tuple[int, Any]] = {}
    start = threading.Barrier(len(good) + len(hostile))

    def ask(name: str, do: str | None) -> None:
        start.wait()
        results[name] = post(port, scored(name, do))

    threads = [threading.Thread(target=ask, args=(n, None)) for n in good]
    threads += [threading.Thread(target=ask, args=(do, do)) for do in hostile]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_plain_kserve_clients_merged_with_failing_calls_all_get_their_rewards(server):
    """No resend: curl and tritonclient cannot tell that a rejected request was valid, so every good
    request must be answered whatever Triton merged it with."""
    hostile = {
        "raise": "behave raised ValueError: this response cannot be scored",
        "exit": "worker process died during the call (exit code 7)",
    }
    good = ["a", "bb", "ccc", "dddd", "eeeee"]
    for _ in range(2):
        results = merged_round(server, good, list(hostile))
        for name in good:
            assert results[name][0] == 200 and rewards_of(results[name][1]) == [len(name)], results[name]
        for do, needle in hostile.items():
            status, answer = results[do]
            assert status == 400 and needle in answer["error"], (do, status, answer)


def test_a_hanging_call_does_not_hold_other_requests(server):
    hung: dict[str, Any] = {}

    def hang() -> None:
        hung["answer"] = post(server, scored("zz", "hang"))

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.1)  # it is being served: the requests below arrive while it hangs
    latencies = []
    while thread.is_alive() and len(latencies) < 20:
        t0 = time.perf_counter()
        status, answer = post(server, scored("abc"))
        latencies.append(time.perf_counter() - t0)
        assert status == 200 and rewards_of(answer) == [3.0], answer
    thread.join(30)
    status, answer = hung["answer"]
    assert status == 400 and "did not answer within reward.timeout_s=3 s" in answer["error"], answer
    # each waits for Triton's queue delay (0.3 s), never for the hanging call (3 s)
    assert len(latencies) >= 2 and max(latencies) < 1.5, latencies
