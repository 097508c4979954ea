"""A real two-host `openaligner train-ppo` run: three network namespaces on one bridge stand for
three machines, each with its own address and nothing else in common but the filesystem (the
output directory must be shared across hosts: every rank reads a checkpoint back on resume).

Host C runs `openaligner serve-critic` bound to its own address with a token; hosts A and B each
run the multi-node torchrun command of docs/ppo.md ("Many processes: torchrun" — this test is that
recipe, flag for flag): one trainer rank per host, c10d rendezvous on A, gloo between A and B,
both ranks sending their micro-batches to C. The run stops after a checkpoint, and the same
command with more steps resumes from it.

Why the recipe sets what it sets (each one was needed here, and is on real machines whose
hostname does not resolve to the address the other hosts reach):

* ``GLOO_SOCKET_IFNAME``: gloo binds the address the hostname resolves to, here 127.0.0.1 (all
  namespaces share the hostname, as many machines map theirs to 127.0.1.1); it would advertise
  loopback to the other rank. Naming the interface makes it use that interface's address.
  (``NCCL_SOCKET_IFNAME`` is NCCL's counterpart on GPUs.)
* ``--local-addr``: the rank-0 node publishes this as the workers' ``MASTER_ADDR``; without it
  that is its fully qualified hostname, which the other host resolves to its own loopback.
* ``--rdzv_conf is_host=...``: the c10d rendezvous store is served by the node whose hostname
  matches the endpoint; with a hostname that does not resolve to the endpoint's address no node
  would serve it and both would wait. ``is_host`` says which node serves it.
* no ``--node_rank``: the c10d rendezvous ignores it (and warns); it numbers the nodes itself.

Skipped, naming why, where namespaces cannot be made (not root, no ``ip``, ``ip netns add``
refused). Every namespace (and with it every veth and the bridge) is removed afterwards, and
every process started in one is killed first, whether the test passed or not.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import procs
import pytest

from openaligner.io.metrics import read_jsonl

# heavy tier (make test-heavy, CI's second step): minutes of whole-process runs, kept out of `make test`
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

IFNAME = "eth0"  # the interface name inside every host namespace (so GLOO_SOCKET_IFNAME is one value)
SUBNET = "10.77.0"  # private to this test's namespaces: nothing in the root namespace gets an address
RDZV_PORT = 29500  # a fresh namespace has every port free: no free-port races with other tests
CRITIC_PORT = 5556
TOKEN = "multihost-secret"
STEPS_FIRST, STEPS_RESUMED = 2, 3  # a checkpoint at step 2 (save_interval), then one more step
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The environment of the recipe: every host has the critic's token (the critic binds a
# non-loopback address); the trainer hosts also name the interface gloo must use.
CRITIC_ENV = {"OPENALIGNER_TOKEN": TOKEN}
TRAINER_ENV = {**CRITIC_ENV, "GLOO_SOCKET_IFNAME": IFNAME}
TRAINER_TIMEOUT_S = 240  # per run of the two hosts; a run takes about 15 s

# Everything the trainer is told besides where things are (trainer_command adds those): the tiny
# actor and the batches (global sizes, split over the 2 ranks), on top of configs/train_ppo.yaml.
TRAINER_KEYS = [
    "actor.tiny=gpt2",
    "actor.tiny_hidden_size=16",
    "actor.tiny_num_layers=1",
    "actor.tiny_num_heads=2",
    "actor.tiny_seed=1",
    "device=cpu",
    "data.seq_length=32",
    "trainer.max_epochs=10",
    "trainer.num_rollout_samples=4",
    "trainer.rollout_micro_batch_size=2",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.val_check_interval=0",
    "trainer.save_interval=2",
    "trainer.length.max_length=4",
    "trainer.seed=3",
    "remote.pad_to_length=16",
    "exp.progress=false",
    "exp.tensorboard=false",
]
# How the trainer is parallelised, one test case each, added to TRAINER_KEYS: sharded, the case
# that needs the most of the network (every forward and backward gathers over both hosts, every
# rank writes its shard of each checkpoint); replicas across hosts cost one more run if wanted.
PARALLEL: dict[str, list[str]] = {"fsdp": ["parallel.strategy=fsdp"]}
# The tiny critic (and reward model) on top of configs/serve_critic.yaml.
CRITIC_KEYS = [
    "model.tiny=gpt2",
    "model.tiny_hidden_size=16",
    "model.tiny_num_layers=1",
    "model.tiny_num_heads=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "optim.warmup_steps=0",
    "server.inference_micro_batch_size=[2]",
    "server.model_forward_micro_batch_size=2",
    "threads=1",
]


@dataclass
class Host:
    """One network namespace standing for a machine: its name and its address on the bridge."""

    ns: str
    ip: str

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Network:
    """Hosts ``a``, ``b`` (the trainer) and ``c`` (the critic) on one bridge, which lives in a
    namespace of its own; what runs in them is started with :meth:`start` so teardown can stop it."""

    hosts: dict[str, Host]
    started: list[procs.Served] = field(default_factory=list)

    def start(
        self, host: str, argv: list[str], env: dict[str, str], served: type[procs.Served] = procs.Served
    ) -> procs.Served:
        """``argv`` in ``host``'s namespace with this environment added to the test's."""
        proc = served(self.hosts[host].cmd(argv), env=env)
        self.started.append(proc)
        return proc


def _ip(args: str) -> None:
    """``ip ARGS`` (names here never hold spaces); raises CalledProcessError with its stderr."""
    subprocess.run(["ip", *args.split()], check=True, capture_output=True, text=True, timeout=30)


def _wire(tag: str, created: list[str]) -> dict[str, Host]:
    """Build the network in namespace ``{tag}-sw`` (already made) and hosts ``{tag}-a/b/c``,
    appending each namespace made to ``created`` as soon as it exists."""
    switch = f"{tag}-sw"
    _ip(f"-n {switch} link add br0 type bridge")
    _ip(f"-n {switch} link set br0 up")
    hosts = {}
    for i, name in enumerate("abc", start=1):
        host = Host(f"{tag}-{name}", f"{SUBNET}.{i}")
        _ip(f"netns add {host.ns}")
        created.append(host.ns)
        _ip(f"-n {switch} link add port-{name} type veth peer name {IFNAME} netns {host.ns}")
        _ip(f"-n {switch} link set port-{name} master br0 up")
        _ip(f"-n {host.ns} addr add {host.ip}/24 dev {IFNAME}")
        _ip(f"-n {host.ns} link set {IFNAME} up")
        _ip(f"-n {host.ns} link set lo up")
        hosts[name] = host
    return hosts


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs in ``ns`` (only this test's processes run in its namespaces)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def network() -> Iterator[Network]:
    """Four namespaces named after this process: a switch holding bridge ``br0``, and hosts a, b, c,
    each with ``eth0`` (a veth whose peer is a bridge port) at ``SUBNET``.1/2/3 and loopback up."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add`), and this test is not running as root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed, so no network namespaces can be made")
    tag = f"oa-mh-{os.getpid()}-{secrets.token_hex(2)}"  # this run's; a leftover never clashes
    try:
        _ip(f"netns add {tag}-sw")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"`ip netns add` was refused: {e.stderr.strip()}")
    created = [f"{tag}-sw"]
    net = Network({})
    try:
        try:
            net.hosts = _wire(tag, created)
        except subprocess.CalledProcessError as e:  # e.g. a kernel without veth or bridge support
            pytest.skip(
                f"the namespaces' network could not be built: `{' '.join(e.cmd)}`: {e.stderr.strip()}"
            )
        yield net
    finally:
        for proc in net.started:
            proc.kill()
        for ns in reversed(created):
            _kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class CriticServer(procs.Served):
    """`openaligner serve-critic`, ready once it prints where it answers."""

    ready_pattern = r"critic server ready at (http://\S+) \(.*"
    ready_group = 0


def _torchrun() -> list[str]:
    """The ``torchrun`` of this interpreter's environment (its console script, else its module)."""
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def critic_command(net: Network, checkpoint_dir: Path) -> list[str]:
    """docs/ppo.md's critic-host command: serve-critic bound to host c's address."""
    return [
        sys.executable, "-m", "openaligner", "serve-critic", str(CONFIGS / "serve_critic.yaml"),
        f"server.host={net.hosts['c'].ip}", f"server.port={CRITIC_PORT}", f"checkpoint.dir={checkpoint_dir}",
        *CRITIC_KEYS,
    ]  # fmt: skip


def trainer_command(
    net: Network, host: str, out: Path, prompts: Path, steps: int, keys: list[str]
) -> list[str]:
    """docs/ppo.md's multi-node trainer command as ``host`` (a: the head, b) runs it; ``keys`` are
    the run's model, batch and step keys."""
    head, this, critic = net.hosts["a"], net.hosts[host], net.hosts["c"]
    return [
        *_torchrun(), "--nnodes", "2", "--nproc_per_node", "1",
        "--rdzv_backend", "c10d", "--rdzv_id", "openaligner-ppo", "--rdzv_endpoint", f"{head.ip}:{RDZV_PORT}",
        "--rdzv_conf", f"is_host={int(this is head)}", "--local-addr", this.ip,
        "-m", "openaligner", "train-ppo", str(CONFIGS / "train_ppo.yaml"),
        f"remote.critic.ip={critic.ip}", f"remote.critic.port={CRITIC_PORT}",
        f"exp.output_dir={out}", f"data.train_path={prompts}", f"trainer.max_steps={steps}",
        *keys,
    ]  # fmt: skip


def run_two_hosts(net: Network, out: Path, prompts: Path, steps: int, keys: list[str]) -> list[str]:
    """Run the trainer on hosts a and b until both exit; asserts that both exited 0 and formed one
    two-node group; returns each host's output. Once one host fails, or ``TRAINER_TIMEOUT_S``
    passes, what still runs is killed (the other host would wait for its peer until a timeout)."""
    # LOGLEVEL=INFO makes torchrun log the worker group it formed (asserted below); nothing else
    env = {**TRAINER_ENV, "LOGLEVEL": "INFO"}
    nodes = [net.start(host, trainer_command(net, host, out, prompts, steps, keys), env) for host in "ab"]
    deadline = time.monotonic() + TRAINER_TIMEOUT_S
    codes = [node.proc.poll() for node in nodes]
    while None in codes and not any(codes) and time.monotonic() < deadline:
        time.sleep(0.2)
        codes = [node.proc.poll() for node in nodes]
    for node in nodes:
        node.kill()
    outputs = [node.output for node in nodes]
    for host, output in zip("ab", outputs, strict=True):  # kept in tmp_path for a look afterwards
        (out.parent / f"host-{host}-{steps}-steps.log").write_text(output)
    everything = "\n---\n".join(o[-4000:] for o in outputs)
    for host, node in zip("ab", nodes, strict=True):
        assert node.proc.returncode == 0, f"host {host} failed:\n{everything}"
    # each host's agent ran one worker of a two-node group: global ranks 0 and 1, one per host
    ranks = [re.findall(r"group_world_size=2\n.*?global_ranks=\[(\d+)\]", o, re.DOTALL) for o in outputs]
    assert sorted(r for found in ranks for r in found) == ["0", "1"], everything
    return outputs


@pytest.mark.parametrize("extra_keys", list(PARALLEL.values()), ids=list(PARALLEL))
def test_two_hosts_train_save_and_resume(network, tmp_path, extra_keys):
    """Two steps (a checkpoint at step 2), then the same command with three steps resumes from
    step 2 on both hosts and runs step 3: one metrics row per step, the final actor written."""
    words = ["add", "sort", "the", "list", "now", "please"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{w} {v}"}) + "\n" for w, v in itertools.pairwise(words))
    )
    out, keys = tmp_path / "run", [*TRAINER_KEYS, *extra_keys]
    server = network.start("c", critic_command(network, tmp_path / "critic"), CRITIC_ENV, CriticServer)
    assert f"at http://{network.hosts['c'].ip}:{CRITIC_PORT}" in server.wait_ready()

    for output in run_two_hosts(network, out, prompts, STEPS_FIRST, keys):
        assert "resumed from" not in output
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2"]
    if "parallel.strategy=fsdp" in extra_keys:  # each host's rank wrote its own shard files
        shards = sorted(p.name for p in (out / "checkpoints" / "step_2" / "actor.dcp").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"], shards

    resumed_from = f"resumed from {out / 'checkpoints' / 'step_2'} at step 2"
    for output in run_two_hosts(network, out, prompts, STEPS_RESUMED, keys):
        assert resumed_from in output, output[-4000:]
    resumed = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == rows  # steps 1 and 2 were not run again
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    assert (out / "actor" / "model.safetensors").is_file()
