"""`openaligner serve-critic` as a real subprocess: trained and saved, stopped by SIGINT, restarted
from its checkpoint directory (same step, same values, original rewards), stopped by SIGTERM; no
Triton process left behind either time."""

import signal
import sys
import time

import procs
import pytest
import torch
from procs import alive, descendants, free_port

from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient
from openaligner.clients.errors import AuthenticationError

pytestmark = pytest.mark.slow

TOKEN = "cli-secret"


class Served(procs.Served):
    """`openaligner serve-critic` with the token in its environment."""

    ready_pattern = r"critic server ready at (http://\S+) \(.*"
    ready_group = 0

    def __init__(self, args: list[str]) -> None:
        super().__init__(
            [sys.executable, "-m", "openaligner", "serve-critic", *args], env={"OPENALIGNER_TOKEN": TOKEN}
        )

    def stop(self, sig: signal.Signals) -> None:
        tree = descendants(self.proc.pid)
        assert "tritonserver" in tree.values(), tree
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        time.sleep(0.5)  # let orphaned children (if any) be seen before checking
        left = {pid: name for pid, name in tree.items() if alive(pid)}
        assert not left, f"processes left behind after {sig.name}: {left}"
        assert self.proc.returncode == 0, self.output[-3000:]


def rollout() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "response_tokens": torch.randint(4, 100, (6, 20), generator=g),
        "response_lengths": torch.tensor([20, 2, 7, 13, 9, 16]),
    }


def test_cli_trains_saves_stops_on_sigint_and_resumes_stopped_by_sigterm(tmp_path, tiny):
    port = free_port()
    args = [
        "model.tiny=gpt2", f"server.port={port}", f"checkpoint.dir={tmp_path / 'ckpt'}", "threads=1",
        "train.global_batch_size=4", "train.micro_batch_size=2", "optim.lr=1e-3", "optim.warmup_steps=0",
    ]  # fmt: skip
    cfg = RemoteCriticConfig(
        pad_to_length=32, critic=CriticAddress(port=port), token=TOKEN, init_timeout_s=10
    )
    batch = rollout()
    want_rewards = tiny.reward_model().infer(batch["response_tokens"], batch["response_lengths"])

    first = Served(args)
    try:
        ready = first.wait_ready()
        assert f"at http://127.0.0.1:{port}" in ready and "step 0" in ready and "need the token" in ready
        with RemoteGPTRMCriticClient(cfg) as client:  # the server took its token from $OPENALIGNER_TOKEN
            rewards, values = client.infer_rm_critic(batch).result()
            torch.testing.assert_close(rewards, want_rewards, atol=1e-5, rtol=1e-5)
            mask = (torch.arange(19)[None, :] < (batch["response_lengths"] - 1)[:, None]).float()
            data = {**batch, "returns": torch.ones(6, 19), "values": values, "mask": mask}
            result = client.train(data).result()
            assert result["critic_step"] == 2.0  # 6 rows → 2 global batches of 4
            assert client.save().result() == {"status": 0, "step": 2}
            _, trained = client.infer_rm_critic(batch).result()
        first.stop(signal.SIGINT)
        assert (
            "SIGINT received: stopping" in first.output and "critic server stopped at step 2" in first.output
        )
    finally:
        first.kill()
    metrics = (tmp_path / "ckpt" / "logs" / "metrics.jsonl").read_text()
    assert '"train/loss"' in metrics and '"train/grad_norm"' in metrics and '"train/lr"' in metrics

    second = Served(args)
    try:
        assert "step 2" in second.wait_ready()
        with RemoteGPTRMCriticClient(cfg) as client:
            rewards, values = client.infer_rm_critic(batch).result()
            torch.testing.assert_close(values, trained, atol=1e-6, rtol=1e-6)  # the saved critic
            torch.testing.assert_close(rewards, want_rewards, atol=1e-5, rtol=1e-5)  # the original RM
            client.token = None
            with pytest.raises(AuthenticationError):
                client.save().result()
        second.stop(signal.SIGTERM)
        assert "SIGTERM received: stopping" in second.output
    finally:
        second.kill()
