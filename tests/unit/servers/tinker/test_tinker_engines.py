"""serve-tinker's sampling engines (servers/tinker/engines.py) wired into the service, with the
vllm engine faked: a stand-in that loads every push into a plain model of the base architecture
(its head untied, as the real engine's is) and samples it with the hf loop. So what these tests
see is what was pushed, and when: a sampler snapshot's save pushes; a sampler of other weights
than the engine holds pushes them first (an old snapshot samples its own weights again); equal
weights are never pushed twice; one engine per base model; a dead engine is replaced; a refusal
of one request is the client's error. The real engine: tests/integration/test_tinker_vllm.py.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from openaligner.algorithms.tinker_losses import tinker_loss
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.lora import merged_copy, merged_state_dict, unwrap
from openaligner.rollout.config import RolloutConfig
from openaligner.rollout.engine import RolloutEngine, RolloutEngineError, RolloutRequest, WeightSource
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.servers.tinker.engines import TinkerEngines
from openaligner.servers.tinker.futures import UserError
from openaligner.servers.tinker.service import TinkerService
from openaligner.trainer.tinker_model import TinkerDatum, TinkerLora, TinkerModel

PROMPT = [10, 20, 30, 40]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "stop": []}


class FakeVLLM(RolloutEngine):
    """What the vllm engine does with weights, in-process: each push builds a fresh plain model
    (untied head) from ``inference_state_dict()`` (strictly: every name, nothing else); generation
    is the hf loop over it, reporting its own log-probs (at temperature 1) as the real one does."""

    name = "vllm"
    shares_weights = False
    built: ClassVar[list[FakeVLLM]] = []

    def __init__(self, cfg: RolloutConfig, model: Any, tokenizer: Any) -> None:
        config = copy.deepcopy(unwrap(model).config)
        config.tie_word_embeddings = False
        self.config, self.tokenizer = config, tokenizer
        self.source: WeightSource | None = None
        self.dirty = False
        self.plain: Any = None
        self.pushes = 0
        self.generates = 0
        self.closed = False
        self.fail_next: RolloutEngineError | None = None
        self.diffs: list[float] = []
        FakeVLLM.built.append(self)

    def update_weights(self, policy: WeightSource, version: int) -> None:
        self.source, self.dirty = policy, True

    def sync_weights(self) -> None:
        if self.dirty:
            assert self.source is not None
            state = {k: v.detach().clone() for k, v in (self.source.inference_state_dict() or {}).items()}
            plain = type(unwrap(self.source.model))(self.config)  # type: ignore[attr-defined]
            plain.load_state_dict(state, strict=True)
            self.plain, self.dirty = plain.eval(), False
            self.pushes += 1

    def generate(self, request: RolloutRequest) -> Any:
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
        self.sync_weights()
        self.generates += 1
        out = HFRolloutEngine(CausalLMActor(self.plain, self.tokenizer, init_policy=False)).generate(request)
        with torch.no_grad():
            lp = torch.log_softmax(self.plain(input_ids=out.tokens).logits.float(), -1)
        return replace(out, logprobs=lp[:, :-1].gather(-1, out.tokens[:, 1:, None])[..., 0])

    def check_logprobs(self, engine_logprobs: Any, trainer_logprobs: Any, mask: Any) -> dict[str, float]:
        d = (engine_logprobs - trainer_logprobs).abs()[mask.bool()]
        self.diffs.append(float(d.max()))
        return {}

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (its head tied to its embedding) with a tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    return tiny.save_causal_lm(directory, "qwen2", hidden_size=32, num_layers=1, num_heads=2)


def make_service(model_dir: Path, tmp_path: Path, engine: str) -> TinkerService:
    FakeVLLM.built = []
    engines = TinkerEngines(RolloutConfig(engine=engine), vllm_factory=FakeVLLM)
    return TinkerService({"tiny": model_dir}, tmp_path / engine, tinker_loss, engines=engines)


def done(service: TinkerService, future: dict[str, Any]) -> Any:
    return service.jobs.get(future["request_id"]).result(timeout=120)  # type: ignore[union-attr]


class Client:
    """One session with one policy on ``service``, driven as the SDK drives it (plain bodies)."""

    def __init__(self, service: TinkerService) -> None:
        self.service = service
        self.sid = service.create_session({})["session_id"]
        body = {
            "session_id": self.sid,
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 2, "seed": 0},
        }
        self.mid = done(service, service.create_model(body))["model_id"]
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def train(self, tokens: list[int]) -> None:
        datum = TinkerDatum(
            torch.tensor(tokens[:-1]),
            {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)},
        )
        seq = self.next_seq()
        done(
            self.service,
            self.service.forward_backward(
                self.mid, seq, [datum], "cross_entropy", {}, False, lambda o, m: m, str(seq).encode()
            ),
        )
        body = {"model_id": self.mid, "seq_id": self.next_seq(), "adam_params": {"learning_rate": 0.5}}
        done(self.service, self.service.optim_step(body))

    def snapshot_sampler(self) -> str:
        seq = self.next_seq()
        body = {"model_id": self.mid, "seq_id": seq, "sampling_session_seq_id": seq, "kind": "snapshot"}
        return str(done(self.service, self.service.save_weights_for_sampler(body))["sampling_session_id"])

    def save_for_sampler(self, name: str) -> str:
        body = {"model_id": self.mid, "seq_id": self.next_seq(), "path": name}
        return str(done(self.service, self.service.save_weights_for_sampler(body))["path"])

    def path_sampler(self, path: str) -> str:
        body = {"session_id": self.sid, "sampling_session_seq_id": self.next_seq(), "model_path": path}
        return str(self.service.create_sampling_session(body)["sampling_session_id"])

    def base_sampler(self) -> str:
        body = {"session_id": self.sid, "sampling_session_seq_id": self.next_seq(), "base_model": "tiny"}
        return str(self.service.create_sampling_session(body)["sampling_session_id"])

    def sample(self, sampler: str, params: dict[str, Any] | None = None, n: int = 1) -> tuple[list, list]:
        body = {
            "sampling_session_id": sampler,
            "num_samples": n,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": params or GREEDY,
        }
        seqs, _ = done(self.service, self.service.asample(body, lambda s, p: (s, p)))
        return [s.tokens.tolist() for s in seqs], [s.logprobs.tolist() for s in seqs]


@pytest.fixture
def pair(model_dir: Path, tmp_path: Path) -> Any:
    """The same client on an hf server and on a (fake) vllm one: same seeds, same weights."""
    hf, vllm = make_service(model_dir, tmp_path, "hf"), make_service(model_dir, tmp_path, "vllm")
    yield Client(hf), Client(vllm)
    hf.close()
    vllm.close()


def test_the_hf_engine_is_the_default_and_never_builds_a_vllm_one(pair):
    hf, _ = pair
    assert hf.service.engines.name == "hf"
    sampler = hf.snapshot_sampler()
    hf.sample(sampler)
    assert FakeVLLM.built == [] and hf.service.engines.vllm == {}


def test_vllm_samples_what_hf_samples_and_a_snapshot_save_pushes_its_weights(pair):
    hf, vllm = pair
    for c in pair:
        c.train([*PROMPT, 50, 60])
    a_hf, a_vllm = hf.snapshot_sampler(), vllm.snapshot_sampler()
    (engine,) = FakeVLLM.built
    assert engine.pushes == 1 and engine.generates == 0  # pushed at the save, before any sample
    tokens, lps = vllm.sample(a_vllm)
    assert (tokens, lps) == hf.sample(a_hf)  # greedy: the same tokens; log-probs: the model's own
    assert engine.pushes == 1 and max(engine.diffs) < 1e-5  # the engine's log-probs agree (checked)
    # a base-model sampler: the engine is pushed the base's weights (and samples otherwise)
    base_tokens, _ = vllm.sample(vllm.base_sampler())
    assert base_tokens != tokens and engine.pushes == 2


def test_an_older_snapshot_samples_its_own_weights_again(pair):
    hf, vllm = pair
    old = [c.snapshot_sampler() for c in pair]
    for c in pair:
        c.train([*PROMPT, 70, 80])
    new = [c.snapshot_sampler() for c in pair]
    (engine,) = FakeVLLM.built
    assert engine.pushes == 2
    new_tokens = vllm.sample(new[1])
    assert new_tokens == hf.sample(new[0]) and engine.pushes == 2
    old_tokens = vllm.sample(old[1])  # other weights than the engine holds: pushed back first
    assert old_tokens == hf.sample(old[0]) and old_tokens != new_tokens and engine.pushes == 3
    assert vllm.sample(old[1]) == old_tokens and engine.pushes == 3  # held now: no second push


def test_a_saved_path_is_pushed_once_and_samples_its_weights(pair):
    hf, vllm = pair
    vllm.sample(vllm.snapshot_sampler())  # the engine runs
    (engine,) = FakeVLLM.built
    for c in pair:
        c.train([*PROMPT, 11, 12])
    paths = [c.save_for_sampler("step1") for c in pair]
    assert engine.pushes == 2  # a named save pushes into the running engine
    samplers = [c.path_sampler(p) for c, p in zip(pair, paths, strict=True)]
    assert vllm.sample(samplers[1]) == hf.sample(samplers[0]) and engine.pushes == 2  # the same weights


def test_a_named_save_starts_no_engine(pair):
    _, vllm = pair
    vllm.train([*PROMPT, 11, 12])
    vllm.save_for_sampler("final")  # a server that only trains (sl_loop) never starts one
    assert FakeVLLM.built == [] and vllm.service.engines.vllm == {}


def test_one_engine_serves_every_model_of_a_base(model_dir, tmp_path):
    service = make_service(model_dir, tmp_path, "vllm")
    try:
        one, two = Client(service), Client(service)
        two.train([*PROMPT, 33, 34])
        s1, s2 = one.snapshot_sampler(), two.snapshot_sampler()
        t1, t2 = one.sample(s1), two.sample(s2)
        assert len(FakeVLLM.built) == 1 and t1 != t2
        assert one.sample(s1) == t1  # switched back: its weights again
    finally:
        service.close()
    assert FakeVLLM.built[0].closed  # the server's close ends its engines


def test_a_dead_engine_is_replaced_and_a_refused_request_is_the_clients_error(pair):
    _, vllm = pair
    sampler = vllm.snapshot_sampler()
    expected = vllm.sample(sampler)
    (engine,) = FakeVLLM.built
    refused = RolloutEngineError("the vllm rollout engine at X refused /generate: over max_model_len")
    refused.status = 400
    engine.fail_next = refused
    with pytest.raises(UserError, match="max_model_len"):
        vllm.sample(sampler)
    assert vllm.sample(sampler) == expected and not engine.closed  # the same engine serves on
    engine.fail_next = RolloutEngineError("the vllm rollout engine died during /generate")
    with pytest.raises(RolloutEngineError, match="died"):
        vllm.sample(sampler)
    assert engine.closed
    assert vllm.sample(sampler) == expected and len(FakeVLLM.built) == 2  # a new engine, pushed again


def test_seeded_samples_repeat_with_per_token_logprobs(pair):
    _, vllm = pair
    sampler = vllm.snapshot_sampler()
    params = {"max_tokens": 5, "temperature": 1.0, "seed": 7, "top_k": 5}
    tokens, lps = vllm.sample(sampler, params, n=3)
    assert vllm.sample(sampler, params, n=3) == (tokens, lps)
    assert [len(t) for t in tokens] == [len(lp) for lp in lps] == [5, 5, 5]
    assert FakeVLLM.built[0].diffs == []  # top_k: the engine's log-probs mean another thing, not compared


# ---------------------------------------------------------------------------- merged weights
def test_merged_state_dict_keeps_an_adapted_tied_head_apart_from_the_embedding():
    """An adapter on a tied head (Tinker's train_unembed) changes the head only: merged_state_dict
    loaded into the untied architecture computes the adapted model's logits; merged_copy merges
    into the one shared tensor (embedding and head both move), so it does not."""
    size = TinySize(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2)
    base = build_tiny_causal_lm("qwen2", size, seed=0)
    assert base.config.tie_word_embeddings
    trained = TinkerModel(base, TinkerLora(rank=2, seed=0))
    with torch.no_grad():
        for p in trained.params.values():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.tensor([[1, 2, 3, 4]])
    want = trained.model(input_ids=x).logits
    config = copy.deepcopy(base.config)
    config.tie_word_embeddings = False
    plain = type(unwrap(trained.model))(config)
    plain.load_state_dict(merged_state_dict(trained.model), strict=True)
    torch.testing.assert_close(plain(input_ids=x).logits, want, atol=1e-5, rtol=1e-5)
    assert (merged_copy(trained.model)(input_ids=x).logits - want).abs().max() > 1e-2


def test_an_untied_engine_is_refused_for_an_attached_engine_and_given_to_a_started_one():
    from openaligner.rollout.engine import EngineSetupError
    from openaligner.rollout.vllm_config import VLLMConfig
    from openaligner.rollout.vllm_engine import VLLMRolloutEngine

    model = build_tiny_causal_lm("qwen2", TinySize(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2))
    actor = CausalLMActor(model, None, init_policy=False)
    started = VLLMRolloutEngine(actor, VLLMConfig(python=sys.executable), untie_head=True)
    assert started.hf_config.tie_word_embeddings is False and started.tied is False
    assert model.config.tie_word_embeddings  # the served model's own config is untouched
    with pytest.raises(EngineSetupError, match="url"):
        VLLMRolloutEngine(actor, VLLMConfig(url="http://127.0.0.1:9"), untie_head=True)


def test_serve_tinker_refuses_an_attached_engine_and_a_missing_interpreter(tmp_path):
    from openaligner.cli.serve_tinker import check_rollout
    from openaligner.config import StartupError
    from openaligner.rollout.vllm_config import VLLMConfig

    check_rollout(RolloutConfig())  # hf: nothing to check
    with pytest.raises(StartupError, match=r"rollout\.vllm\.url"):
        check_rollout(RolloutConfig(engine="vllm", vllm=VLLMConfig(url="http://127.0.0.1:5557")))
    with pytest.raises(StartupError, match="make rollout-setup"):
        check_rollout(RolloutConfig(engine="vllm", vllm=VLLMConfig(python=str(tmp_path / "nope"))))
    check_rollout(RolloutConfig(engine="vllm", vllm=VLLMConfig(python=sys.executable)))


# ---------------------------------------------------------------------------- hf: the merged copy
@pytest.fixture(scope="module")
def llama_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (its head untied) with a tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    return tiny.save_causal_lm(directory, "llama", hidden_size=32, num_layers=2, num_heads=2)


def unmerged(client: Client, sampler: str) -> tuple[list, list]:
    """``client.sample(sampler)`` (greedy) drawn from the unmerged trained model itself, and the
    training forward's log-probs of what it drew."""
    from openaligner.servers.tinker.sampling import SampleRequest, TinkerSampling, sample_many

    service = client.service
    served, opened = service.models[client.mid], service.samplers[sampler]
    params = TinkerSampling.parse(GREEDY, default_max_tokens=6, vocab_size=10_000)
    with served.trainer.weights(service._sampler_weights(opened, served)) as model:
        actor = CausalLMActor(model, served.tokenizer, init_policy=False)
        engine = HFRolloutEngine(actor, per_row_streams=True)
        ((seqs, _),) = sample_many(
            engine, model, [SampleRequest(torch.tensor(PROMPT), 1, params)], tokenizer=served.tokenizer
        )
        tokens = seqs[0].tokens
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + tokens.tolist()])).logits
            lp = torch.log_softmax(logits.float(), -1)
        scored = lp[0, len(PROMPT) - 1 : -1].gather(-1, tokens[:, None])[:, 0]
    return [tokens.tolist()], [scored.tolist()]


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_hf_samples_a_merged_copy_as_the_unmerged_model_and_scores_with_the_trained_one(
    which, model_dir, llama_dir, tmp_path
):
    """llama: an untied head; qwen2: a tied head carrying an adapter (train_unembed, the default),
    which the copy must hold apart from its embedding."""
    directory = llama_dir if which == "llama" else model_dir
    service = make_service(directory, tmp_path, "hf")
    try:
        client = Client(service)
        tied = bool(service.models[client.mid].trainer.model.config.tie_word_embeddings)
        assert tied == (which == "qwen2")
        client.train([*PROMPT, 50, 60])
        sampler = client.snapshot_sampler()
        tokens, lps = client.sample(sampler)
        (copy_model,) = service.engines.copies.values()  # it sampled the merged copy
        assert service.engines.merges == 1 and not copy_model.config.tie_word_embeddings
        want_tokens, want_lps = unmerged(client, sampler)
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-6, rtol=0)
        # the base model samples itself: no copy, no merge
        client.sample(client.base_sampler())
        assert service.engines.merges == 1 and len(service.engines.copies) == 1
    finally:
        service.close()
    assert service.engines.copies == {}


def test_hf_merges_its_copy_only_when_the_weights_change_and_old_snapshots_sample_their_own(
    model_dir, tmp_path
):
    service = make_service(model_dir, tmp_path, "hf")
    try:
        client = Client(service)
        old = client.snapshot_sampler()
        old_tokens = client.sample(old)
        assert client.sample(old) == old_tokens and service.engines.merges == 1  # held: not merged again
        client.train([*PROMPT, 70, 80])
        new = client.snapshot_sampler()
        new_tokens = client.sample(new)
        assert new_tokens != old_tokens and service.engines.merges == 2
        assert new_tokens[0] == unmerged(client, new)[0]
        again = client.sample(old)  # an older snapshot: its own weights merged back
        assert again == old_tokens and service.engines.merges == 3
        assert again[0] == unmerged(client, old)[0]
        assert client.sample(old) == old_tokens and service.engines.merges == 3
        other = Client(service)  # another model of the base shares the copy
        other.sample(other.snapshot_sampler())
        assert service.engines.merges == 4 and len(service.engines.copies) == 1
        # the copy lives as long as a model of its base: freed with the last one's session
        service.finish_session(client.sid)
        done(service, {"request_id": service.jobs.submit(lambda: None)})  # the drop has run
        assert len(service.engines.copies) == 1
        service.finish_session(other.sid)
        done(service, {"request_id": service.jobs.submit(lambda: None)})
        assert service.engines.copies == {} and service.engines.copy_holds == {}
    finally:
        service.close()
