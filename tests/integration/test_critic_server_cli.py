"""`openaligner serve-critic` as a real subprocess: trained and saved, stopped by SIGINT, restarted
from its checkpoint directory (same step, same values, original rewards), stopped by SIGTERM; no
Triton process left behind either time."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from procs import alive, descendants, free_port

from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient
from openaligner.clients.errors import AuthenticationError

pytestmark = pytest.mark.slow

TOKEN = "cli-secret"


class Served:
    """A CLI server subprocess whose output is collected in the background."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENALIGNER_TOKEN": TOKEN}
        cmd = [sys.executable, "-m", "openaligner", "serve-critic", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 90.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(r"critic server ready at (http://\S+) \(.*", self.output)
            if match:
                return match.group(0)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"server did not become ready:\n{self.output[-3000:]}")

    def stop(self, sig: signal.Signals) -> None:
        tree = descendants(self.proc.pid)
        assert "tritonserver" in tree.values(), tree
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        time.sleep(0.5)  # let orphaned children (if any) be seen before checking
        left = {pid: name for pid, name in tree.items() if alive(pid)}
        assert not left, f"processes left behind after {sig.name}: {left}"
        assert self.proc.returncode == 0, self.output[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def rollout() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "response_tokens": torch.randint(4, 100, (6, 20), generator=g),
        "response_lengths": torch.tensor([20, 2, 7, 13, 9, 16]),
    }


def test_cli_trains_saves_stops_on_sigint_and_resumes_stopped_by_sigterm(tmp_path, tiny):
    port = free_port()
    args = [
        "model.tiny=true", f"server.port={port}", f"checkpoint.dir={tmp_path / 'ckpt'}", "threads=1",
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
