"""Merged ``asample`` calls (futures.Merge, sampling.sample_many): calls queued back to back that
sample the same weights with the same settings run as ONE engine generate and one scoring forward,
each answered only its own samples, equal to the call run alone; never merged past a training
call, nor across settings or weights; one refused call fails alone; ``max_batch_rows`` caps a
merged run. The job table's merging is also tested on plain callables (no model).

The worker is held on a gate job while the calls queue, so what queues together is known; the hf
engine's ``generate`` is wrapped to count its calls and rows.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from openaligner.algorithms.tinker_losses import tinker_loss
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.rollout.engine import RolloutEngineError, RolloutRequest
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.servers.tinker.futures import FutureTable, Merge, UserError
from openaligner.servers.tinker.sampling import SampleRequest, TinkerSampling, sample_many
from openaligner.servers.tinker.service import TinkerService
from openaligner.trainer.tinker_model import TinkerDatum

GREEDY = {"max_tokens": 6, "temperature": 0.0, "stop": []}
SEEDED = {"max_tokens": 8, "temperature": 1.0, "stop": list(range(3, 13))}  # some rows stop early
POISON = 7  # a prompt starting with it is refused by the engine (see counted)


# ---------------------------------------------------------------------------- the job table
def held(table: FutureTable) -> threading.Event:
    """A gate job at the head of ``table``: what is submitted until it is set queues behind it."""
    gate = threading.Event()
    table.submit(lambda: gate.wait(30))
    return gate


def test_a_merging_job_takes_the_like_jobs_directly_behind_it_and_never_past_another():
    runs: list[list[str]] = []

    def run(items: Any) -> list[Any]:
        runs.append(list(items))
        return [lambda i=i: f"{i}!" for i in items]

    table = FutureTable()
    gate = held(table)
    ids = {
        name: table.submit(
            (lambda n=name: runs.append([n]) or f"{n} alone"),
            merge=None if group is None else Merge(group, 1, name, run),
        )
        for name, group in [("a", "g"), ("b", "g"), ("step", None), ("c", "g"), ("d", "h"), ("e", "g")]
    }
    gate.set()
    results = {n: table.get(i).result(timeout=30) for n, i in ids.items()}  # type: ignore[union-attr]
    table.close()
    # a and b as one; the step alone; c, d, e each alone (each's neighbour is of another group)
    assert runs == [["a", "b"], ["step"], ["c"], ["d"], ["e"]]
    assert results == {
        "a": "a!", "b": "b!", "step": "step alone", "c": "c alone", "d": "d alone", "e": "e alone"
    }  # fmt: skip


@pytest.mark.parametrize("wait_s", [0.0, 2.0])
def test_a_merging_job_on_an_empty_queue_waits_for_like_jobs_sent_just_after_it(wait_s: float) -> None:
    """A client's calls sent together reach the server ms apart: with ``merge_wait_s`` the first
    waits for the others instead of running alone; a job without a Merge ends the wait at once."""
    runs: list[list[str]] = []
    started = threading.Event()

    def run(items: Any) -> list[Any]:
        runs.append(list(items))
        return [lambda i=i: i for i in items]

    table = FutureTable(merge_wait_s=wait_s)
    first = table.submit(lambda: runs.append(["a"]) or "a", merge=Merge("g", 1, "a", run))
    table.submit(lambda: started.set())  # not a merging job: runs after the merged ones
    time.sleep(0.05)  # the worker has taken "a" from an otherwise empty queue
    ids = [table.submit(lambda n=n: runs.append([n]) or n, merge=Merge("g", 1, n, run)) for n in "bc"]
    for i in (first, *ids):
        table.get(i).result(timeout=30)  # type: ignore[union-attr]
    started.wait(30)
    table.close()
    if wait_s == 0:
        assert runs[0] == ["a"]  # ran alone: nothing was queued behind it when it was taken
    else:
        # the unmerging job queued behind "a" ended its wait: "a" ran alone before it, b and c after
        assert runs[0] == ["a"] and runs[1] == ["b", "c"]


def test_a_merging_job_waits_for_calls_that_arrive_within_merge_wait_s() -> None:
    runs: list[list[str]] = []

    def run(items: Any) -> list[Any]:
        runs.append(list(items))
        return [lambda i=i: i for i in items]

    table = FutureTable(merge_wait_s=2.0, max_merged_rows=3)
    ids = [table.submit(lambda: runs.append(["a"]) or "a", merge=Merge("g", 1, "a", run))]
    for n in "bc":
        time.sleep(0.05)  # each arrives after the worker took the first one
        ids.append(table.submit(lambda n=n: runs.append([n]) or n, merge=Merge("g", 1, n, run)))
    for i in ids:
        table.get(i).result(timeout=30)  # type: ignore[union-attr]
    table.close()
    assert runs == [["a", "b", "c"]]  # one run; it did not wait out the 2 s once the cap was reached


def test_a_merged_run_raising_any_exception_leaves_each_job_answered_and_the_worker_alive():
    class Abort(BaseException):  # not an Exception: escapes an `except Exception`
        pass

    def run(items: Any) -> list[Any]:
        raise Abort

    table = FutureTable()
    gate = held(table)
    ids = [table.submit(lambda n=n: f"{n} alone", merge=Merge("g", 1, n, run)) for n in "ab"]
    gate.set()
    assert [table.get(i).result(timeout=30) for i in ids] == ["a alone", "b alone"]  # type: ignore[union-attr]
    later = table.submit(lambda: "still serving")
    assert table.get(later).result(timeout=30) == "still serving"  # type: ignore[union-attr]
    table.close()


def test_a_finished_job_keeps_nothing_its_work_used():
    """Finished jobs stay in the table (for their futures) for ``keep`` more jobs: what their work
    held (datums, a dropped model) must not stay with them."""

    class Payload:
        pass

    def run(items: Any) -> list[Any]:
        return [lambda: "merged" for _ in items]

    table = FutureTable()
    payloads = [Payload(), Payload()]
    refs = [weakref.ref(p) for p in payloads]
    alone = table.submit(lambda p=payloads[0]: type(p).__name__)
    merged = table.submit(lambda p=payloads[1]: "x", merge=Merge("g", 1, payloads[1], run))
    assert table.get(alone).result(timeout=30) == "Payload"  # type: ignore[union-attr]
    assert table.get(merged).result(timeout=30) == "x"  # type: ignore[union-attr]  (alone: nothing behind it)
    # the worker lets go of a job just after settling its future: once a later job has run, it has
    after = table.submit(lambda: None)
    table.get(after).result(timeout=30)  # type: ignore[union-attr]
    del payloads
    gc.collect()
    assert [r() for r in refs] == [None, None]
    table.close()


def test_a_merged_run_takes_at_most_max_merged_rows():
    sizes: list[int] = []

    def run(items: Any) -> list[Any]:
        sizes.append(sum(items))
        return [lambda: None for _ in items]

    table = FutureTable(max_merged_rows=4)
    gate = held(table)
    ids = [
        table.submit(lambda r=r: sizes.append(-r), merge=Merge("g", r, r, run)) for r in (2, 2, 2, 1, 1, 5, 3)
    ]
    gate.set()
    for i in ids:
        table.get(i).result(timeout=30)  # type: ignore[union-attr]
    table.close()
    assert sizes == [4, 4, -5, -3]  # 2+2, 2+1+1, then 5 (over the cap: alone), then 3 alone


def test_a_failed_merged_run_runs_each_job_alone_so_only_the_bad_one_fails():
    def run(items: Any) -> list[Any]:
        raise RuntimeError("the batch as a whole failed")

    def alone(name: str) -> Any:
        if name == "bad":
            raise UserError("bad is refused")
        return name

    table = FutureTable()
    gate = held(table)
    ids = [table.submit(lambda n=n: alone(n), merge=Merge("g", 1, n, run)) for n in ("x", "bad", "y")]
    gate.set()
    futures = [table.get(i) for i in ids]
    assert futures[0].result(timeout=30) == "x" and futures[2].result(timeout=30) == "y"  # type: ignore[union-attr]
    with pytest.raises(UserError, match="bad is refused"):
        futures[1].result(timeout=30)  # type: ignore[union-attr]
    table.close()


def test_close_cancels_the_queued_jobs_and_refuses_new_ones():
    table = FutureTable()
    gate = held(table)
    queued = table.submit(lambda: "never")
    threading.Timer(0.2, gate.set).start()
    table.close()
    assert table.get(queued).cancelled()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="stopping"):
        table.submit(lambda: None)


def test_sample_many_scores_in_chunks_under_the_logits_budget_with_the_same_log_probs(monkeypatch):
    """A merged run's scoring forward keeps its float32 logits under LOGITS_BUDGET: split into
    row chunks, with the log-probs of one forward over all rows (to float rounding)."""
    from openaligner.models.actor import CausalLMActor
    from openaligner.servers.tinker import sampling

    model = build_tiny_causal_lm("llama", TinySize(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2))
    params = TinkerSampling.parse(SEEDED, default_max_tokens=8, vocab_size=40)
    requests = [
        SampleRequest(torch.tensor([3, 4, 5]), 2, replace(params, seed=1), prompt_logprobs=True),
        SampleRequest(torch.tensor([6, 7]), 3, replace(params, seed=2), prompt_logprobs=True),
    ]
    engine = HFRolloutEngine(CausalLMActor(model, None, init_policy=False), per_row_streams=True)

    def run() -> tuple[list[Any], int]:
        forwards = 0
        original = model.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal forwards
            forwards += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)
        try:
            out = sample_many(engine, model, requests, tokenizer=None)
        finally:
            monkeypatch.setattr(model, "forward", original)
        return out, forwards

    whole, whole_forwards = run()
    monkeypatch.setattr(sampling, "LOGITS_BUDGET", 2 * 11 * 40)  # two rows of the widest (3 + 8) at a time
    chunked, chunked_forwards = run()
    # the same generate (same forwards) either way; the scoring: 1 forward, then 3 (5 rows: 2 + 2 + 1)
    assert chunked_forwards - whole_forwards == 2
    for (seqs_a, plp_a), (seqs_b, plp_b) in zip(whole, chunked, strict=True):
        for a, b in zip(seqs_a, seqs_b, strict=True):
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
        torch.testing.assert_close(plp_a, plp_b, rtol=0, atol=1e-6, equal_nan=True)


def test_sample_many_refuses_requests_of_other_settings():
    model = build_tiny_causal_lm("llama", TinySize(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2))
    a = TinkerSampling.parse(GREEDY, default_max_tokens=1, vocab_size=40)
    b = TinkerSampling.parse({**GREEDY, "max_tokens": 5}, default_max_tokens=1, vocab_size=40)
    requests = [SampleRequest(torch.tensor([3, 4]), 1, a), SampleRequest(torch.tensor([5]), 1, b)]
    with pytest.raises(ValueError, match="every sampling setting but the seed"):
        sample_many(None, model, requests, tokenizer=None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the service
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen2-batching")
    tok = build_char_tokenizer()
    size = TinySize(vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=2)
    build_tiny_causal_lm("qwen2", size, seed=0).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every hf generate call; a request holding a prompt that starts with POISON is
    refused as an engine refuses one (HTTP 400)."""
    rows: list[int] = []
    original = HFRolloutEngine.generate

    def generate(self: HFRolloutEngine, request: RolloutRequest) -> Any:
        rows.append(int(request.prompts.shape[0]))
        if bool((request.prompts[:, 0] == POISON).any()):
            refused = RolloutEngineError("the engine refused a prompt starting with the poison token")
            refused.status = 400
            raise refused
        return original(self, request)

    monkeypatch.setattr(HFRolloutEngine, "generate", generate)
    return rows


class Served:
    """A service with one LoRA policy, its calls made as the SDK makes them (plain bodies)."""

    def __init__(self, model_dir: Path, tmp_path: Path, **kwargs: Any) -> None:
        self.service = TinkerService({"tiny": model_dir}, tmp_path, tinker_loss, **kwargs)
        self.sid = self.service.create_session({})["session_id"]
        body = {
            "session_id": self.sid,
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 2, "seed": 0},
        }
        self.mid = self.done(self.service.create_model(body))["model_id"]
        self.seq = 0

    def done(self, future: dict[str, Any]) -> Any:
        return self.service.jobs.get(future["request_id"]).result(timeout=120)  # type: ignore[union-attr]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def sampler(self, kind: str = "inflight") -> str:
        seq = self.next_seq()
        body = {"model_id": self.mid, "seq_id": seq, "sampling_session_seq_id": seq, "kind": kind}
        return str(self.done(self.service.save_weights_for_sampler(body))["sampling_session_id"])

    def base_sampler(self) -> str:
        body = {"session_id": self.sid, "sampling_session_seq_id": self.next_seq(), "base_model": "tiny"}
        return str(self.service.create_sampling_session(body)["sampling_session_id"])

    def asample(
        self, sampler: str, prompt: list[int], params: dict[str, Any], n: int = 1, prompt_lp: bool = False
    ) -> dict[str, Any]:
        body = {
            "sampling_session_id": sampler,
            "num_samples": n,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": params,
            "prompt_logprobs": prompt_lp,
        }
        return self.service.asample(body, lambda s, p: (s, p))

    def train_futures(self, tokens: list[int]) -> list[dict[str, Any]]:
        """forward_backward + optim_step (cross-entropy on ``tokens``, lr 0.5), queued."""
        datum = TinkerDatum(
            torch.tensor(tokens[:-1]),
            {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)},
        )
        seq = self.next_seq()
        fwd = self.service.forward_backward(
            self.mid, seq, [datum], "cross_entropy", {}, False, lambda o, m: m, str(seq).encode()
        )
        body = {"model_id": self.mid, "seq_id": self.next_seq(), "adam_params": {"learning_rate": 0.5}}
        return [fwd, self.service.optim_step(body)]

    def close(self) -> None:
        self.service.close()


@pytest.fixture
def served(model_dir: Path, tmp_path: Path) -> Iterator[Served]:
    s = Served(model_dir, tmp_path)
    yield s
    s.close()


def plain(result: Any) -> tuple[list[list[int]], list[list[float]], list[float] | None]:
    seqs, plp = result
    return (
        [s.tokens.tolist() for s in seqs],
        [s.logprobs.tolist() for s in seqs],
        None if plp is None else plp[1:].tolist(),
    )


def assert_same(got: Any, want: Any) -> None:
    """Equal tokens; log-probs equal to float tolerance (another batch, another padding)."""
    (gt, gl, gp), (wt, wl, wp) = plain(got), plain(want)
    assert gt == wt
    for a, b in zip(gl, wl, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    assert (gp is None) == (wp is None)
    if gp is not None:
        torch.testing.assert_close(torch.tensor(gp), torch.tensor(wp), atol=1e-5, rtol=1e-5)


def queued_together(served: Served, calls: list[Any]) -> list[Any]:
    """Queue ``calls`` (each returning a future, or a list of them) behind a gate, then release."""
    gate = held(served.service.jobs)
    futures = [call() for call in calls]
    gate.set()
    return [[served.done(f) for f in fs] if isinstance(fs, list) else served.done(fs) for fs in futures]


def test_concurrent_asamples_run_as_one_generate_each_answered_its_own_samples(served, counted):
    """Fails on main: there each call is its own generate ([2, 3, 1])."""
    sampler = served.sampler()
    calls = [  # prompts of three lengths (left-padded in the generate, right-padded when scored)
        ([10, 20, 30, 40], 2, {**SEEDED, "seed": 1}, True),
        ([11, 21], 3, {**SEEDED, "seed": 2}, False),
        ([12, 22, 32, 42, 52, 62], 1, SEEDED, True),  # unseeded: its tokens are its own draw
    ]
    merged = queued_together(
        served, [lambda c=c: served.asample(sampler, c[0], c[2], c[1], c[3]) for c in calls]
    )
    assert counted == [6]  # one generate of all six rows
    assert [len(r[0]) for r in merged] == [2, 3, 1] and merged[0][1] is not None and merged[1][1] is None
    for (prompt, n, params, plp), got in zip(calls[:2], merged[:2], strict=True):
        alone = served.done(served.asample(sampler, prompt, params, n, plp))
        assert_same(got, alone)  # the seeded calls: their own samples, as alone
    # the unseeded one: its own prompt's samples; their log-probs are the model's alone
    seqs, plp = merged[2]
    hf = served.service.models[served.mid].trainer.model
    full = torch.tensor([calls[2][0] + seqs[0].tokens.tolist()])
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=full).logits.float(), -1)[0, :-1].gather(-1, full[0, 1:, None])[
            :, 0
        ]
    torch.testing.assert_close(seqs[0].logprobs, lp[5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plp[1:], lp[:5], atol=1e-5, rtol=1e-5)
    assert counted == [6, 2, 3]


def test_samples_queued_around_a_training_step_see_the_weights_of_their_place(served, counted):
    """asample, asample, forward_backward + optim_step, asample, asample queued together: the first
    two merge and see the old weights, the last two merge and see the new; nothing merges across
    the step. Fails on main: there four generates ([1, 1, 1, 1]), not two."""
    sampler, prompt = served.sampler("inflight"), [10, 20, 30, 40]
    old = served.done(served.asample(sampler, prompt, GREEDY))
    results = queued_together(
        served,
        [
            lambda: served.asample(sampler, prompt, GREEDY),
            lambda: served.asample(sampler, [11, 21], GREEDY),
            lambda: served.train_futures([*prompt, 50, 60, 70]),
            lambda: served.asample(sampler, prompt, GREEDY),
            lambda: served.asample(sampler, [11, 21], GREEDY),
        ],
    )
    new = served.done(served.asample(sampler, prompt, GREEDY))
    assert plain(old)[0] != plain(new)[0]  # the step changed the greedy samples
    assert counted == [1, 2, 2, 1]
    assert_same(results[0], old)
    assert_same(results[3], new)
    assert plain(results[1])[0] != plain(results[4])[0]  # the other prompt saw the step too


def test_calls_of_other_settings_or_other_weights_are_not_merged(served, counted):
    """Fails on main for the one pair that does merge ([2, 1, 1, 1, 1] here, five ones there)."""
    live, base = served.sampler(), served.base_sampler()
    for f in served.train_futures([10, 20, 30, 40, 50]):  # so the policy and the base model differ
        served.done(f)
    drawn = {"max_tokens": 8, "temperature": 1.0, "stop": [], "seed": 3}
    prompt = [10, 20, 30, 40]
    calls = [
        (live, GREEDY),
        (live, GREEDY),  # merges with the first
        (live, {**GREEDY, "max_tokens": 5}),
        (live, drawn),
        (base, drawn),  # the same settings, other weights
        (live, {**GREEDY, "stop": [5]}),
    ]
    got = queued_together(served, [lambda c=c: served.asample(c[0], prompt, c[1]) for c in calls])
    assert counted == [2, 1, 1, 1, 1]
    for (sampler, params), result in zip(calls, got, strict=True):
        assert_same(result, served.done(served.asample(sampler, prompt, params)))
    assert plain(got[3])[0] != plain(got[4])[0]


def test_one_refused_call_fails_alone_and_the_others_get_their_samples(served, counted):
    """The merged generate is refused (one prompt is); each call then runs alone: the refused one
    answers the client's error, the others their samples. Fails on main: there no merged attempt
    ([3, 1, 1, 1] here, [1, 1, 1] there)."""
    sampler = served.sampler()
    prompts = [[10, 20, 30], [POISON, 20, 30], [12, 22]]
    gate = held(served.service.jobs)
    futures = [served.asample(sampler, p, {**SEEDED, "seed": 5}) for p in prompts]
    gate.set()
    first, third = served.done(futures[0]), served.done(futures[2])
    with pytest.raises(UserError, match="poison"):
        served.done(futures[1])
    assert counted == [3, 1, 1, 1]
    assert_same(first, served.done(served.asample(sampler, prompts[0], {**SEEDED, "seed": 5})))
    assert_same(third, served.done(served.asample(sampler, prompts[2], {**SEEDED, "seed": 5})))


def test_max_batch_rows_caps_a_merged_generate(model_dir, tmp_path, counted):
    """Fails on main (no cap to honour: one generate per call, [2, 2, 2, 2, 2, 6])."""
    served = Served(model_dir, tmp_path, max_batch_rows=4)
    try:
        sampler = served.sampler()
        sizes = [2, 2, 2, 2, 2, 6]
        queued_together(served, [lambda n=n: served.asample(sampler, [10, 20], GREEDY, n) for n in sizes])
    finally:
        served.close()
    assert counted == [4, 4, 2, 6]  # a call above the cap runs alone


def test_serve_tinker_takes_max_batch_rows():
    from openaligner.cli.serve_tinker import TinkerModelSettings

    assert TinkerModelSettings().max_batch_rows == 64
    with pytest.raises(ValueError, match="max_batch_rows"):
        TinkerModelSettings(max_batch_rows=0)
