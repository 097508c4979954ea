"""The ``vllm`` rollout engine, trainer side: starts one vLLM engine process with the rollout
environment's Python (or attaches to those ``openaligner serve-rollout`` started), shares each
rollout among them, and pushes the policy's weights into them before the next rollout.

Owns :class:`VLLMRolloutEngine`: the engines' lifecycle (started ones are ended on :meth:`close`,
attached ones only detached), the model directory the engine loads from, the mapping of
:class:`~openaligner.models.generation.SamplingParams` onto vLLM's, when a push happens and which
transfer carries it (``weights_file`` / ``weights_http`` / ``weights_collective``). Must not
import vLLM nor know about rewards, losses or the PPO loop. Engine side: ``vllm_worker.py``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import http.client
import json
import logging
import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from openaligner import distributed as dp
from openaligner.rollout.engine import (
    EngineSetupError,
    RolloutEngine,
    RolloutEngineError,
    RolloutRequest,
    WeightSource,
)
from openaligner.rollout.vllm_config import VLLMConfig, engine_urls
from openaligner.rollout.vllm_link import EngineLink, end_group, resolve_python, shm_dir, spawn_worker
from openaligner.rollout.weights_file import WEIGHTS_FILE, engine_state_dict, place_weights, write_weights
from openaligner.rollout.weights_http import upload

if TYPE_CHECKING:
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import Generation

log = logging.getLogger(__name__)

S = TypeVar("S")
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def split_rows(rows: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of ``range(rows)``, sizes differing by at most one, larger
    first (an engine may get none when there are fewer rows than engines)."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (i < extra)
        out.append(slice(start, start + n))
        start += n
    return out


def on_each(items: list[S], work: Callable[[S], T]) -> list[T]:
    """``work(item)`` for every item, at once (a thread each: the engines work in parallel), the
    results in ``items``' order; the first failure (in that order) is raised once all ended."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(len(items), thread_name_prefix="vllm-engine") as pool:
        futures = [pool.submit(work, item) for item in items]
        concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class VLLMRolloutEngine(RolloutEngine):
    """Rollouts from vLLM engines in their own processes (``rollout.engine=vllm``).

    Sampling means what it means for the ``hf`` engine: temperature, top-k, top-p, min and max
    new tokens and the stop ids (the tokenizer's EOS included; only they end a response, and
    ``min_new_tokens`` bans exactly them); greedy is vLLM's temperature 0. Stop strings: the
    engine cannot match them (it runs without a tokenizer), so a response is cut after generation
    where the ``hf`` loop would have ended it (:func:`~openaligner.models.generation.stop_string_length`).
    Seeds: row ``i`` is sampled from its own stream seeded with
    ``seeds[i]``, so a row's tokens do not depend on its batch-mates (nor on which engine drew it).

    Weights: :meth:`start` writes the policy's weights and the model's config to a directory in
    ``/dev/shm`` and starts the engine on it. :meth:`update_weights` only records that the weights
    changed; the next :meth:`generate` writes them (``policy.inference_state_dict()``: LoRA merged,
    shards gathered; for a LoRA policy, to the engine the run started, only the merged adapted
    layers and their modules' other tensors: ``inference_update_state_dict``) as
    ``model.safetensors`` there and has the engine reload them and drop its prefix cache — once,
    however many optimizer steps came between. The time it takes is
    ``timing/weight_sync_s``. The first rollout after a push checks the engine's log-probs against
    the trainer's (:meth:`check_logprobs`).

    Engines: one the run starts, or the standalone engines ``rollout.vllm.url`` lists (one or
    more ``openaligner serve-rollout``). Rank 0 talks to them: under torchrun every rank's rows
    go out in one round (each engine gets a contiguous share, all at once) and each rank gets its
    own rows back; a push reaches every engine before the next rollout. The metrics are over every
    rank's rows.
    """

    name = "vllm"
    shares_weights = False

    def __init__(self, actor: CausalLMActor, cfg: VLLMConfig, *, untie_head: bool = False) -> None:
        """Raises :class:`EngineSetupError` when the engine cannot be started (no interpreter) or,
        with ``cfg.url``, attached to (nothing answers at one of its URLs, one serves another
        architecture or vocabulary, or another trainer holds it).

        ``untie_head``: the engine's model keeps an output head of its own even where the actor's
        config ties it to the input embedding (the weights pushed then carry ``lm_head.weight``
        apart: an adapter on the head makes the two differ). Only for an engine it starts."""
        self.cfg = cfg
        self.attached = cfg.url is not None  # attach to engines of `openaligner serve-rollout`
        self.python = None if self.attached else resolve_python(cfg.python)
        self.dtype = cfg.dtype  # of the weights pushed: the engine's (an attached one reports it)
        self.policy: WeightSource = actor
        self.device = actor.device  # the trainer's: a collective push over NCCL is sent from it
        self.pad_id = int(actor.pad_id)
        self.tokenizer = actor.tokenizer
        self.hf_config = _plain_config(actor)
        if untie_head and getattr(self.hf_config, "tie_word_embeddings", False):
            if cfg.url is not None:
                raise EngineSetupError(
                    "an engine of openaligner serve-rollout ties its head as its model does; this "
                    "run needs an untied one (set rollout.vllm.url=null)"
                )
            self.hf_config.tie_word_embeddings = False
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self.links: list[EngineLink] = []  # rank 0, once started: the engines it talks to
        self.started = False  # every rank: the engines serve (and, attached, are leased)
        self.workdir: Path | None = None  # an engine the run starts: its directory
        self.version = 0
        self._dirty = False  # the policy changed since the engine's weights were written
        self._check_next = False  # the next rollout is the first after a push: check its log-probs
        self._sync_s = 0.0
        self._syncs = 0
        self._urls = engine_urls(cfg.url) if cfg.url is not None else []  # attached: the engines
        self._infos = [self._probe(url) for url in self._urls]  # and each one's GET /info
        if self._urls:
            workdirs = [info.get("workdir") for info in self._infos]
            twice = [
                u
                for u, w in zip(self._urls, workdirs, strict=True)
                if w is not None and workdirs.count(w) > 1
            ]
            if twice:
                raise EngineSetupError(
                    f"rollout.vllm.url={cfg.url}: {' and '.join(twice)} are one engine (the same "
                    "working directory): list each engine once"
                )
            dtypes = {info["dtype"] for info in self._infos}
            if len(dtypes) > 1:
                raise EngineSetupError(
                    f"rollout.vllm.url={cfg.url}: the engines compute in different dtypes "
                    f"({', '.join(sorted(dtypes))}): one run's rollouts must come from one model; start "
                    "them with the same vllm.dtype"
                )
            self.dtype = dtypes.pop()

    @property
    def url(self) -> str:
        """The engines' URLs, comma-separated (rank 0, once started; else ``""``)."""
        return ",".join(link.url for link in self.links)

    # ------------------------------------------------------------------ attaching
    def _probe(self, url: str) -> dict[str, Any]:
        """``GET /info`` of the engine at ``url`` (one of ``rollout.vllm.url``), checked against
        the actor and for a lease held by another trainer.

        Raises:
            EngineSetupError: naming ``rollout.vllm.url`` and what is wrong.
        """
        several = len(self._urls) > 1
        where = f"{url} (of rollout.vllm.url)" if several else f"rollout.vllm.url={self.cfg.url}"
        try:
            with urllib.request.urlopen(url + "/info", timeout=min(30.0, self.cfg.request_timeout_s)) as r:
                info = dict(json.loads(r.read()))
            model, lease = dict(info["model"]), info["lease"]
            _DTYPES[info["dtype"]]  # one this side can cast to
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            raise EngineSetupError(
                f"{where}: no vllm rollout engine answers there ({type(e).__name__}: {e}); start one with "
                "`openaligner serve-rollout model=DIR` and set the URL it prints"
            ) from None
        if not info.get("standalone"):
            raise EngineSetupError(
                f"{where} is an engine another run started for itself, not one of openaligner serve-rollout"
            )
        mine = self.hf_config.to_dict()
        differ = [
            f"{k} {v!r} (the actor's: {mine[k]!r})"
            for k, v in model.items()
            if mine.get(k) is not None and v is not None and v != mine[k]
        ]
        if differ:
            raise EngineSetupError(
                f"{where} serves another model than the actor: {', '.join(differ)}; its weights cannot "
                "take the actor's: start openaligner serve-rollout on the actor's model (or one of its "
                "architecture and vocabulary)"
            )
        if lease is not None and float(lease["idle_s"]) < float(info.get("lease_ttl_s", 0)):
            raise EngineSetupError(
                f"{where} is attached to another trainer ({lease['holder']}, last request "
                f"{float(lease['idle_s']):.0f} s ago): two runs would overwrite each other's weights; stop "
                "that run, or start another engine with openaligner serve-rollout"
            )
        return info

    def _attach(self) -> str:
        """Take every engine's lease (rank 0); if one refuses, those taken are given back."""
        links = [
            EngineLink(url, self.cfg.request_timeout_s, info)
            for url, info in zip(self._urls, self._infos, strict=True)
        ]
        try:
            for link in links:
                link.attach(self.cfg.weight_transfer)
        except RolloutEngineError:
            for link in links:
                link.detach()
            raise
        self.links = links
        return self.url

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Write the policy's weights, start the engine on them (rank 0) and wait until it serves.
        Every rank calls it (gathering a sharded policy's weights is a collective)."""
        if self.started:
            return
        if self.attached:
            # the engines may hold another run's weights, or this run's before a resume: the first
            # rollout pushes the actor's, and is checked against them
            _on_leader(self._attach)
            self.started = self._dirty = True
            return
        state = self.policy.inference_state_dict()
        _on_leader(lambda: self._start(state))
        self.started = True

    def _start(self, state: dict[str, torch.Tensor] | None) -> str:
        self.workdir = shm_dir("openaligner-vllm-")
        model_dir = self.workdir / "model"
        model_dir.mkdir()
        self.hf_config.save_pretrained(model_dir)
        self._write_weights(model_dir, state)
        c = self.cfg
        assert self.python is not None
        link = EngineLink("", c.request_timeout_s)
        link.log_path = self.workdir / "engine.log"
        with link.log_path.open("wb") as log_file:
            link.proc, ready = spawn_worker(self.python, model_dir, self.workdir, c, log_file, [])
        self.links = [link]  # stopped with the run, whatever happens next
        log.info("vllm rollout engine: starting (pid %d, log %s)", link.proc.pid, link.log_path)
        deadline = time.monotonic() + c.start_timeout_s
        while not ready.exists():
            if link.proc.poll() is not None:
                raise RolloutEngineError(f"the vllm rollout engine failed to start: {link.describe_exit()}")
            if time.monotonic() > deadline:
                tail = link.log_tail()
                self.stop()
                raise RolloutEngineError(
                    f"the vllm rollout engine did not serve within rollout.vllm.start_timeout_s="
                    f"{c.start_timeout_s:g}; its log ends:\n{tail}"
                )
            time.sleep(0.2)
        port = json.loads(ready.read_text())["port"]
        self._dirty = False
        link.url = f"http://127.0.0.1:{port}"
        log.info("vllm rollout engine: serving on %s", link.url)
        return link.url

    def stop(self) -> None:
        """End a started engine's whole process group (SIGTERM, then SIGKILL after 15 s) and
        remove its directory; attached engines are detached from (their leases given back) and
        keep serving."""
        links, self.links, self.started = self.links, [], False
        for link in links:
            link.detach()
            if link.proc is not None:
                end_group(link.proc)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    # ------------------------------------------------------------------ weights
    def update_weights(self, policy: WeightSource, version: int) -> None:
        """Record that the weights changed; the next :meth:`generate` pushes them (once)."""
        self.policy = policy
        self.version = version
        self._dirty = True

    def sync_weights(self) -> None:
        """Push the weights :meth:`update_weights` recorded now rather than at the next
        :meth:`generate` (starting the engine on them if it is not running; every rank calls
        it); nothing when the engine holds them already."""
        if not self.started:
            self.start()
        if self._dirty:
            self._push()

    def _write_weights(self, model_dir: Path, state: dict[str, torch.Tensor] | None) -> None:
        assert state is not None, "rank 0 holds the whole state dict"
        write_weights(model_dir, state, _DTYPES[self.dtype], self.tied)

    def _push(self) -> None:
        t0 = time.perf_counter()
        state = self._changed_state()
        if state is None:
            state = self.policy.inference_state_dict()  # a collective for a sharded policy

        def push() -> None:
            if self.cfg.weight_transfer == "collective":
                assert state is not None, "rank 0 holds the whole state dict"
                tensors = engine_state_dict(state, _DTYPES[self.dtype], self.tied, own_copies=False)
                on_each(self.links, lambda link: link.send_collective(tensors, self.device))
                return
            if not self.attached:
                assert self.workdir is not None
                model_dir = self.workdir / "model"
                self._write_weights(model_dir, state)
                self.links[0].post("/reload_weights", {"path": str(model_dir)})
                return
            # written once, then handed to every engine at once (linked into the directories of
            # those on this machine, uploaded to the others)
            staging = shm_dir("openaligner-push-")
            try:
                self._write_weights(staging, state)
                on_each(self.links, lambda link: _hand_over(link, staging / WEIGHTS_FILE))
            finally:
                shutil.rmtree(staging, ignore_errors=True)

        _on_leader(push)
        self._dirty = False
        self._check_next = True
        self._sync_s += time.perf_counter() - t0
        self._syncs += 1

    def _changed_state(self) -> dict[str, torch.Tensor] | None:
        """Only what the optimizer changes (a LoRA policy's merged adapted layers and the other
        tensors of their modules: ``inference_update_state_dict``), or None: the whole weights.
        Only to the engine this run started, by file: it loaded the whole weights at its start
        and took every push since (an attached engine may hold another run's, or this run's
        before a resume), and vLLM's in-place reload keeps every layer the file does not name."""
        if self.attached or self.cfg.weight_transfer == "collective":
            return None
        update = getattr(self.policy, "inference_update_state_dict", None)
        return update() if update is not None else None

    def pop_metrics(self) -> dict[str, float]:
        """``timing/weight_sync_s``: seconds spent pushing weights since the last call (gather,
        write, reload), when there was a push."""
        if not self._syncs:
            return {}
        out = {"timing/weight_sync_s": self._sync_s}
        self._sync_s, self._syncs = 0.0, 0
        return out

    # ------------------------------------------------------------------ generation
    def generate(self, request: RolloutRequest) -> Generation:
        from openaligner.models.generation import Generation, stop_string_length

        s = request.sampling
        if s.stop_strings and self.tokenizer is None:
            raise EngineSetupError(
                "stop strings (trainer.sampling.end_strings) need the actor's tokenizer to decode "
                "responses, and this actor has none"
            )
        assert s.stop_token_ids is not None, "a rollout request carries resolved stop ids"
        if not self.started:
            self.start()
        if self._dirty:
            self._push()
        plens = request.prompt_lengths.tolist()
        # every rank's rows go out in one round (rank 0 sends them); each rank takes its own back
        rows = dp.gather_objects(
            (
                [row[:n] for row, n in zip(request.prompts.tolist(), plens, strict=True)],
                request.seeds.tolist(),
            )
        )
        prompts = [p for ps, _ in rows for p in ps]
        seeds = [x for _, ss in rows for x in ss]
        settings = {
            "greedy": s.greedy,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "max_tokens": s.max_new_tokens,
            "min_tokens": s.min_new_tokens,
            "stop_token_ids": list(s.stop_token_ids),
        }
        out = _on_leader(lambda: self._generate_on_engines(prompts, seeds, settings))
        start = sum(len(ps) for ps, _ in rows[: dp.rank()])
        mine = slice(start, start + len(plens))
        responses, lps, finish = out["token_ids"][mine], out["logprobs"][mine], out["finish_reasons"][mine]
        if s.stop_strings:
            assert self.tokenizer is not None
            for i, resp in enumerate(responses):
                # the engine matches no strings (it has no tokenizer): it sampled on past a stop
                # string, and the response is cut where the hf engine's loop would have ended it
                n = stop_string_length(resp, s.stop_strings, s.min_new_tokens, self.tokenizer)
                if n is not None:
                    responses[i], lps[i], finish[i] = resp[:n], lps[i][:n], "stop"
        totals = [p + len(r) for p, r in zip(plens, responses, strict=True)]
        b, width = len(plens), max(totals)
        tokens = torch.full((b, width), self.pad_id, dtype=torch.int64)
        logprobs = torch.zeros(b, width - 1, dtype=torch.float32)
        for i, (p, resp, lp) in enumerate(zip(plens, responses, lps, strict=True)):
            tokens[i, :p] = request.prompts[i, :p]
            tokens[i, p : totals[i]] = torch.tensor(resp, dtype=torch.int64)
            logprobs[i, p - 1 : totals[i] - 1] = torch.tensor(lp, dtype=torch.float32)
        return Generation(
            tokens=tokens,
            sequence_lengths=torch.tensor(totals, dtype=torch.int64),
            prompt_lengths=request.prompt_lengths.to("cpu", torch.int64),
            is_end=torch.tensor([f == "stop" for f in finish], dtype=torch.bool),
            logprobs=logprobs,
        )

    def _generate_on_engines(
        self, prompts: list[list[int]], seeds: list[int], settings: dict[str, Any]
    ) -> dict[str, list[Any]]:
        """``POST /generate`` of every row (rank 0): each engine gets a contiguous share, all at
        once; their answers, checked, joined in the rows' order."""
        parts = split_rows(len(prompts), len(self.links))
        shares = [
            (link, part) for link, part in zip(self.links, parts, strict=True) if part.stop > part.start
        ]

        def one(share: tuple[EngineLink, slice]) -> dict[str, Any]:
            link, part = share
            body = {"prompts": prompts[part], "seeds": seeds[part], **settings}
            return check_generate_reply(link.post("/generate", body), part.stop - part.start, link.url)

        replies = on_each(shares, one)
        return {
            key: [x for r in replies for x in r[key]] for key in ("token_ids", "logprobs", "finish_reasons")
        }

    def check_logprobs(
        self, engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """The mismatch metrics; raises :class:`RolloutEngineError` when, on the first rollout
        after a weight push, the mean |Δ log p| exceeds ``rollout.vllm.max_logprob_diff`` (the
        engine generated from other weights than the trainer's), and warns when a later rollout
        does. Only without top-k/top-p truncation: with it, vLLM's log-probs are renormalised over
        the kept tokens and the trainer's are not, so they differ by design."""
        stats = _global_mismatch(engine_logprobs, trainer_logprobs, mask)
        just_pushed, self._check_next = self._check_next, False
        limit, mean = self.cfg.max_logprob_diff, stats["logprob_diff_mean"]
        sampling = getattr(self.policy, "sampling", None)
        truncated = sampling is not None and (sampling.top_k > 0 or sampling.top_p < 1.0)
        if limit > 0 and mean > limit and not truncated:
            message = (
                f"the vllm rollout engine's log-probs differ from the trainer's by {mean:.4g} nats per "
                f"token on average (max {stats['logprob_diff_max']:.4g}; rollout.vllm.max_logprob_diff="
                f"{limit:g})"
            )
            if just_pushed:
                raise RolloutEngineError(
                    f"{message} on the first rollout after pushing the weights of optimizer step "
                    f"{self.version}: the engine is not generating from the trainer's weights (raise the "
                    "limit only if the engine computes in a lower precision than the trainer)"
                )
            log.warning("%s", message)
        return stats


def check_generate_reply(out: dict[str, Any], rows: int, url: str | None) -> dict[str, Any]:
    """``out``, a ``POST /generate`` answer, if it holds ``rows`` rows of ``token_ids`` (non-negative
    integers), ``logprobs`` (one number per token) and ``finish_reasons`` (strings); otherwise a
    :class:`RolloutEngineError` (not an IndexError deep in :meth:`VLLMRolloutEngine.generate`)."""
    tokens, lps, finish = out.get("token_ids"), out.get("logprobs"), out.get("finish_reasons")
    ok = (
        isinstance(tokens, list)
        and isinstance(lps, list)
        and isinstance(finish, list)
        and len(tokens) == len(lps) == len(finish) == rows
        and all(isinstance(f, str) for f in finish)
        and all(
            isinstance(t, list)
            and isinstance(lp, list)
            and len(t) == len(lp)
            and all(type(x) is int and x >= 0 for x in t)
            and all(type(x) in (int, float) for x in lp)
            for t, lp in zip(tokens, lps, strict=True)
        )
    )
    if not ok:
        raise RolloutEngineError(
            f"the vllm rollout engine at {url} answered /generate with other than {rows} rows of token_ids "
            f"(ids >= 0), logprobs (one number per token) and finish_reasons (strings): {str(out)[:300]}"
        )
    return out


def _on_leader(work: Callable[[], T]) -> T:
    """``work()`` run on rank 0, its result (or its error, as a :class:`RolloutEngineError` unless
    it is an :class:`EngineSetupError`) on every rank: the other ranks must not wait forever in
    the next collective for a rank 0 that failed."""
    if not dp.is_distributed():
        return work()
    outcome: tuple[bool, Any] = (True, None)
    if dp.is_leader():
        try:
            outcome = (True, work())
        except (RolloutEngineError, EngineSetupError) as e:
            outcome = (False, e)
        except Exception as e:  # an OSError of /dev/shm, a store's RuntimeError, ...
            # reaches every rank as an engine error: the others must not wait in the next collective
            failed = RolloutEngineError(
                f"the vllm rollout engine's side of this run failed: {type(e).__name__}: {e}"
            )
            failed.__cause__ = e
            outcome = (False, failed)
    ok, value = dp.broadcast_object(outcome)
    if not ok:
        raise value
    return cast(T, value)


def _global_mismatch(
    engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """:func:`~openaligner.algorithms.logprob_mismatch` over every rank's rows (the same on all)."""
    keep = mask.bool()
    d = (engine_logprobs.double() - trainer_logprobs.double()).abs()[keep]
    sums = dp.all_reduce_sum(torch.stack([d.sum(), d.exp().sum(), torch.tensor(float(d.numel()))]).double())
    top = dp.all_reduce_max(d.max() if d.numel() else torch.zeros((), dtype=torch.float64))
    n = float(sums[2])
    if n == 0:
        return {"logprob_diff_mean": 0.0, "logprob_diff_max": 0.0, "token_prob_error": 1.0}
    return {
        "logprob_diff_mean": float(sums[0]) / n,
        "logprob_diff_max": float(top),
        "token_prob_error": float(sums[1]) / n,
    }


def _plain_config(actor: CausalLMActor) -> Any:
    """The Hugging Face config of the policy as a plain causal LM (LoRA and sharding wrappers
    looked through), with ``architectures`` set: vLLM picks its model class by it."""
    from openaligner.models.lora import is_peft_model

    model: Any = actor.model
    base = model.get_base_model() if is_peft_model(model) else model
    config = copy.deepcopy(base.config)
    if not getattr(config, "architectures", None):
        name = type(base).__name__
        config.architectures = [name.removeprefix("FSDP")]  # FSDP2 renames the class it shards
    return config


def _hand_over(link: EngineLink, staged: Path) -> None:
    """Hand the engine ``staged`` (a whole ``model.safetensors``) and have it reload: into its own
    directory when it is on this machine (:func:`~openaligner.rollout.weights_file.place_weights`),
    else streamed as ``PUT /weights`` (:func:`~openaligner.rollout.weights_http.upload`)."""
    if link.local_dir is not None:
        place_weights(staged, link.local_dir)
    else:
        upload(link, staged)
    link.post("/reload_weights", {})  # from its weights directory
