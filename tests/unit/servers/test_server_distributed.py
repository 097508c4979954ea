"""The rank-0 / subscriber loop: in-process with a scripted world, and for real with 2 gloo ranks."""

import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openaligner import distributed as dp
from openaligner.distributed import CollectiveFailure
from openaligner.servers.distributed import Opcode, Rank0Dispatcher, run_subscriber_loop


def follow_script(monkeypatch, opcodes):
    """Make this process a non-leader rank whose broadcasts replay ``opcodes``."""
    script = list(opcodes)
    monkeypatch.setattr(dp, "rank", lambda: 1)
    monkeypatch.setattr(dp, "broadcast_int", lambda value: script.pop(0))


def test_subscriber_loop_follows_opcodes_until_stop(monkeypatch):
    seen = []

    def forward(payload):
        seen.append(payload)
        if len(seen) == 2:
            raise CollectiveFailure("failed on every rank")  # logged; the loop goes on

    follow_script(
        monkeypatch, [Opcode.NOOP, Opcode.FORWARD, Opcode.FORWARD, Opcode.NOOP, Opcode.FORWARD, Opcode.STOP]
    )
    run_subscriber_loop({Opcode.FORWARD: forward})
    assert seen == [None, None, None]  # subscribers never get the payload; NOOP runs nothing


def test_subscriber_loop_refuses_unknown_opcodes(monkeypatch):
    follow_script(monkeypatch, [9])
    with pytest.raises(RuntimeError, match="received opcode 9 but only knows"):
        run_subscriber_loop({Opcode.FORWARD: lambda p: None})


def test_dispatcher_reserves_stop_and_noop_and_refuses_calls_after_stop():
    with pytest.raises(ValueError, match="reserved"):
        Rank0Dispatcher({Opcode.STOP: lambda p: None})
    d = Rank0Dispatcher({Opcode.FORWARD: lambda p: p * 2})
    assert d.call(Opcode.FORWARD, 21) == 42
    d.stop()
    d.stop()  # idempotent
    with pytest.raises(RuntimeError, match="stopping"):
        d.call(Opcode.FORWARD, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# heartbeats every 0.5 s: eight may come late on a loaded machine before rank 1's wait times out
PG_TIMEOUT_S = 4.0


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    address = f"tcp://127.0.0.1:{port}"
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timeout)
    calls = []

    def forward(payload):
        x = dp.broadcast_tensor(payload)
        local = dp.local_rows(x)

        def step():
            if dp.rank() == 1 and float(x[0, 0]) < 0:
                raise RuntimeError("simulated failure on rank 1 only")
            return local * (dp.rank() + 1)

        y = dp.run_guarded(step)
        calls.append(tuple(x.shape))
        return dp.all_gather_rows(y, same_shape=True)

    handlers = {Opcode.FORWARD: forward}
    if rank == 0:
        d = Rank0Dispatcher(handlers, heartbeat_s=0.5)
        first = d.call(Opcode.FORWARD, torch.arange(12.0).reshape(4, 3))
        # idle past the process-group timeout: only heartbeats keep rank 1 legal
        time.sleep(PG_TIMEOUT_S + 1.5)
        second = d.call(Opcode.FORWARD, torch.ones(2, 5, dtype=torch.float64))
        try:
            d.call(Opcode.FORWARD, -torch.ones(2, 1))
            failure = ""
        except CollectiveFailure as e:
            failure = str(e)
        third = d.call(Opcode.FORWARD, torch.full((2, 2), 3.0))  # still in step after a failure
        d.stop()
        torch.save(
            {"first": first, "second": second, "failure": failure, "third": third}, f"{out_dir}/rank0.pt"
        )
    else:
        run_subscriber_loop(handlers)
        torch.save({"calls": calls}, f"{out_dir}/rank1.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_two_gloo_ranks_heartbeat_failure_and_stop(tmp_path):
    mp.spawn(_two_rank_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    x = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(r0["first"], torch.cat([x[:2] * 1, x[2:] * 2]))  # rank r scales its half by r+1
    assert r0["second"].dtype == torch.float64 and torch.equal(
        r0["second"], torch.tensor([[1.0] * 5, [2.0] * 5])
    )
    assert "rank(s) [1]" in r0["failure"]  # the failure on rank 1 reached rank 0 instead of a hang
    assert torch.equal(r0["third"], torch.tensor([[3.0, 3.0], [6.0, 6.0]]))
    assert r1["calls"] == [(4, 3), (2, 5), (2, 2)]  # the failed call is not recorded; STOP ended the loop
