"""The one collective API: identities in a world of one, and every collective with 2 gloo ranks."""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openaligner import distributed as dp


def test_a_world_of_one_is_the_identity():
    assert (dp.rank(), dp.world_size(), dp.is_leader(), dp.is_distributed()) == (0, 1, True, False)
    assert dp.collective_device().type == "cpu"
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(dp.broadcast_tensor(x), x) and dp.broadcast_int(7) == 7
    assert dp.broadcast_object({"a": 1}) == {"a": 1} and dp.gather_objects(3) == [3]
    assert torch.equal(dp.all_reduce_sum(x), x) and torch.equal(dp.all_reduce_max(x), x)
    assert torch.equal(dp.all_gather_rows(dp.local_rows(x)), x)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    dp.average_gradients([p])
    dp.sum_gradients([p])
    assert p.grad.tolist() == [3.0, 3.0]
    dp.barrier()
    assert dp.run_guarded(lambda: 5) == 5
    with pytest.raises(dp.CollectiveFailure, match=r"rank\(s\) \[0\]") as info:
        dp.run_guarded(lambda: 1 / 0)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert dp.run_guarded(lambda: {"step": 3}, leader_only=True) == {"step": 3}
    with pytest.raises(ZeroDivisionError):  # rank 0 raises the step's own error
        dp.run_guarded(lambda: 1 / 0, "checkpoint", leader_only=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    r = float(rank)
    out: dict[str, object] = {"rank": dp.rank(), "world": dp.world_size(), "leader": dp.is_leader()}
    out["int"] = dp.broadcast_int(41 if rank == 0 else None)
    sent = torch.arange(6, dtype=torch.bfloat16).reshape(1, 2, 3)
    out["tensor"] = dp.broadcast_tensor(sent if rank == 0 else None)
    out["object"] = dp.broadcast_object({"from": rank})
    out["objects"] = dp.gather_objects(rank * 10)
    x = torch.tensor([1.0 + r, 5.0 - r])
    out["sum"], out["max"], out["x"] = dp.all_reduce_sum(x), dp.all_reduce_max(x), x.clone()
    # ragged: rank 0 has 1 row of width 2, rank 1 has 2 rows of width 3
    ragged = torch.full((1 + rank, 2 + rank), r + 1)
    out["ragged"] = dp.all_gather_rows(ragged, pad_value=-1)
    out["same"] = dp.all_gather_rows(
        dp.local_rows(torch.arange(4.0).reshape(4, 1)) * (r + 1), same_shape=True
    )
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([2.0 + r, 4.0])  # b has no gradient on rank 0
    b.grad = torch.tensor([6.0]) if rank == 1 else None
    dp.average_gradients([a, b])
    out["mean"] = (a.grad.clone(), b.grad.clone())
    dp.sum_gradients([a])
    out["sum_of_means"] = a.grad.clone()

    def fail_on_rank_1() -> int:
        if rank == 1:
            raise RuntimeError("simulated")
        return 1

    try:
        dp.run_guarded(fail_on_rank_1)
        out["guarded"] = ""
    except dp.CollectiveFailure as e:
        out["guarded"] = str(e)
    ran_on: list[int] = []

    def on_leader() -> dict[str, int]:
        ran_on.append(rank)
        return {"from": rank}

    out["leader_result"] = dp.run_guarded(on_leader, leader_only=True)
    out["leader_ran_on"] = ran_on

    def leader_fails() -> None:
        raise KeyError("disk full")

    try:
        dp.run_guarded(leader_fails, "checkpoint", leader_only=True)
        out["leader_failure"] = ("", "")
    except Exception as e:
        out["leader_failure"] = (type(e).__name__, str(e))
    dp.barrier()
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_ranks(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in (0, 1))
    assert (r0["rank"], r0["world"], r0["leader"], r1["rank"], r1["leader"]) == (0, 2, True, 1, False)
    for r in (r0, r1):
        assert r["int"] == 41 and r["object"] == {"from": 0} and r["objects"] == [0, 10]
        assert r["tensor"].dtype == torch.bfloat16 and r["tensor"].tolist() == [[[0, 1, 2], [3, 4, 5]]]
        assert r["sum"].tolist() == [3.0, 9.0] and r["max"].tolist() == [2.0, 5.0]
        assert r["ragged"].tolist() == [[1, 1, -1], [2, 2, 2], [2, 2, 2]]
        assert r["same"].tolist() == [[0.0], [1.0], [4.0], [6.0]]  # rank r's half times r + 1
        assert r["mean"][0].tolist() == [2.5, 4.0] and r["mean"][1].tolist() == [3.0]  # missing = 0
        assert r["sum_of_means"].tolist() == [5.0, 8.0]
        assert "the step failed on rank(s) [1] (rank 1: RuntimeError: simulated)" in r["guarded"]  # on both
    assert r0["x"].tolist() == [1.0, 5.0]  # the reductions leave their input alone
    # a leader-only step runs on rank 0 alone; its result, or its failure, reaches every rank
    assert r0["leader_ran_on"] == [0] and r1["leader_ran_on"] == []
    assert r0["leader_result"] == r1["leader_result"] == {"from": 0}
    assert r0["leader_failure"] == ("KeyError", "'disk full'")  # rank 0: the step's own error
    assert r1["leader_failure"] == (
        "PeerFailedError",
        "rank 0's checkpoint failed, so this rank stops too: KeyError: 'disk full'",
    )
    assert issubclass(dp.PeerFailedError, dp.CollectiveFailure)


FINISH_SCRIPT = """
import atexit, sys
import torch.distributed as dist
from openaligner import distributed as dp
store = dist.FileStore(sys.argv[1], 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
atexit.register(lambda: open(sys.argv[2], "w").write("ran"))
dp.shutdown()
print("done", flush=False)  # buffered: finish must flush it
sys.exit(dp.finish(3))
raise AssertionError("finish returned in a process that left a group")
"""


def test_finish_ends_a_rank_with_its_code_after_exit_handlers_and_returns_it_elsewhere(tmp_path):
    """A rank that left its group ends in ``finish`` with the command's code, its atexit handlers
    run and its output flushed (interpreter teardown, where library threads can abort a finished
    run, is skipped); a process that never joined a group gets its code back."""
    import subprocess
    import sys

    marker = tmp_path / "atexit"
    run = subprocess.run(
        [sys.executable, "-c", FINISH_SCRIPT, str(tmp_path / "store"), str(marker)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip() == "done"
    assert marker.read_text() == "ran"
    assert dp.finish(5) == 5  # this test process never left a group
