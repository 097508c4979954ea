"""`openaligner serve-reward` as a real subprocess: one rank stopped by SIGINT, two ranks under
torchrun (replicas or shards) stopped by SIGTERM. Both must answer like the offline model and
leave no Triton behind."""

import json
import re
import signal
import sys
import time
import urllib.request

import pytest
import torch
from procs import Served, alive, descendants, free_port

from openaligner.clients.reward import RemoteGPTRMClient, RemoteRMConfig
from openaligner.data.render import Renderer, SequenceLayout
from openaligner.servers.reward import make_tokenize_func

pytestmark = pytest.mark.slow


def check_answers_and_stop(served: Served, port: int, tiny, sig: signal.Signals) -> str:
    try:
        url = served.wait_ready()
        assert url == f"http://127.0.0.1:{port}"
        tree = descendants(served.proc.pid)
        assert "tritonserver" in tree.values(), tree
        g = torch.Generator().manual_seed(3)
        batch = {
            "response_tokens": torch.randint(4, 100, (5, 20), generator=g),
            "response_lengths": torch.tensor([20, 1, 7, 13, 2]),
        }
        with RemoteGPTRMClient(RemoteRMConfig(port=port, pad_to_length=32, init_timeout_s=10)) as rm:
            got = rm.infer_rm(batch).result()
        want = tiny.reward_model().infer(batch["response_tokens"], batch["response_lengths"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        check_other_frameworks_formats(port, tiny)
        served.proc.send_signal(sig)
        served.proc.wait(timeout=60)
        time.sleep(0.5)  # let orphaned children (if any) be seen before checking
        left = {pid: name for pid, name in tree.items() if alive(pid)}
        assert not left, f"processes left behind after {sig.name}: {left}"
        return served.output
    finally:
        served.kill()


def post(port: int, path: str, doc: object) -> object:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(doc).encode())
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def check_other_frameworks_formats(port: int, tiny) -> None:
    """OpenRLHF's, slime's and vLLM's formats score as the offline model scores the text laid out as
    train-rm lays it out (a model trained on raw text: prompt and response tokenized apart)."""
    model, tok = tiny.reward_model(), tiny.tokenizer

    def split(prompt: str, response: str) -> float:
        p, r = Renderer(tok, SequenceLayout()).example_ids(prompt, {"role": "assistant", "content": response})
        return float(model.infer(torch.tensor([p + r]), torch.tensor([len(p + r)]))[0])

    def whole(text: str) -> float:
        return float(model.infer(*make_tokenize_func(tok, max_length=256)([text]))[0])

    got = post(
        port,
        "/get_reward",
        {"query": ["sort: 3 1 2 = 1 2 3"], "prompts": ["sort: 3 1 2 ="], "labels": ["1 2 3"]},
    )
    assert got["rewards"] == got["scores"] == pytest.approx([split("sort: 3 1 2 =", " 1 2 3")], abs=1e-5)
    got = post(port, "/remote_rm", {"prompt": "hello", "response": " world", "label": None})
    assert got == pytest.approx(split("hello", " world"), abs=1e-5)
    got = post(port, "/classify", {"model": "rm", "input": ["hello world", "abc"], "use_activation": False})
    assert [d["probs"][0] for d in got["data"]] == pytest.approx(
        [whole("hello world"), whole("abc")], abs=1e-5
    )


def test_cli_single_rank_stops_cleanly_on_sigint(tiny):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "openaligner",
        "serve-reward",
        "model.tiny=gpt2",
        f"server.port={port}",
        "threads=1",
    ]
    served = Served(cmd)
    output = check_answers_and_stop(served, port, tiny, signal.SIGINT)
    assert served.proc.returncode == 0, output[-3000:]
    assert "SIGINT received: stopping" in output and "reward model server stopped" in output
    # a stop we asked for prints nothing that looks like a fault (Triton's own chatter, the python
    # backend's resource tracker warning about shared memory)
    for noise in ("resource_tracker", "leaked shared_memory", "Non-graceful termination", "Signal (2)"):
        assert noise not in output, output[-3000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cli_two_ranks_under_torchrun_stop_cleanly_on_sigterm(tiny, strategy):
    """Replicas, or shards (parallel.strategy=fsdp: every rank takes part in every forward)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "openaligner", "serve-reward", "model.tiny=gpt2", f"server.port={port}", "threads=1",
        "server.inference_micro_batch_size=[2]", "server.model_forward_micro_batch_size=2",
        f"parallel.strategy={strategy}",
    ]  # fmt: skip
    served = Served(cmd)
    output = check_answers_and_stop(served, port, tiny, signal.SIGTERM)
    assert ("2 rank(s), sharded)" if strategy == "fsdp" else "2 rank(s))") in output
    # rank 1 computed its share of the batch and left its loop on rank 0's STOP
    assert re.search(r"rank 1: STOP received after [1-9]\d* call\(s\)", output), output[-3000:]
    assert "reward model server stopped" in output
