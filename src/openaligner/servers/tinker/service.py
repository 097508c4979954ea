"""What the Tinker API's calls do, on plain values: sessions, the models and samplers each session
owns, the base models served, checkpoints on ``tinker://`` paths, and the jobs behind every
future.

Owns :class:`TinkerService`: each route of :mod:`openaligner.servers.tinker.app` is one method
taking the decoded request (a dict, or the decoded protobuf) and returning a JSON-ready dict or a
request id; the work itself runs as jobs of a :class:`~openaligner.servers.tinker.futures.FutureTable`.
Model ids are ``<session_id>:train:<model_seq_id>`` (what the SDK derives on load) with a random
session id, so only the session that created a model can name it. Must not know HTTP or the wire
encoding. Design notes: docs/tinker.md, "How it works".
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openaligner.models.positions import position_limit
from openaligner.rollout.config import RolloutConfig
from openaligner.rollout.engine import EngineSetupError, RolloutEngineError
from openaligner.servers.tinker.engines import TinkerEngines
from openaligner.servers.tinker.futures import FutureTable, Merge, UserError
from openaligner.servers.tinker.sampling import (
    SampledSequence,
    SampleRequest,
    TinkerSampling,
    merge_key,
    prompt_tokens,
    sample_many,
)
from openaligner.trainer.tinker_model import (
    AdamStep,
    TinkerCritic,
    TinkerDatum,
    TinkerInputError,
    TinkerLora,
    TinkerModel,
    build_trained,
    embedding_rows,
    read_checkpoint_lora,
    read_checkpoint_meta,
)

LOGGER = logging.getLogger(__name__)

NAME = re.compile(r"^(?!.*\.tmp-)[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""A checkpoint name: what may follow ``weights/`` or ``sampler_weights/`` in a path (never a
``.tmp-`` directory, where a checkpoint is written before it is renamed into place)."""
KINDS = {"weights": "weights", "sampler_weights": "sampler_weights"}

LossLookup = Callable[[str], Any]
"""A loss's name -> the loss (a :class:`~openaligner.algorithms.tinker_losses.TinkerLoss`: callable
as :data:`~openaligner.trainer.tinker_model.TinkerLossFn`, with ``resolve_config`` and
``check_inputs``); ``ValueError`` naming the supported ones for any other name."""


@dataclass(frozen=True)
class BaseModelSource:
    """One served base model: the name clients use and the Hugging Face directory it loads from."""

    name: str
    path: Path


@dataclass
class Session:
    id: str
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    last_seen_s: float = field(default_factory=time.monotonic)
    finished: bool = False


@dataclass
class ServedModel:
    """A trained model of a session: its base (the name the client sent), its trainer and the
    adapters its snapshot samplers sample from, by weight version (oldest first)."""

    model_id: str
    session_id: str
    base: BaseModelSource
    base_name: str  # exactly what the client sent as base_model
    trainer: TinkerModel
    tokenizer: PreTrainedTokenizerBase | None
    snapshots: OrderedDict[int, dict[str, torch.Tensor]] = field(default_factory=OrderedDict)


@dataclass
class Sampler:
    """A sampling session: a model's adapters frozen at a snapshot (``snapshot``: a saved path's
    adapters; ``version``: one of the model's kept snapshots; neither: its live weights) or, with
    ``model`` None, the base model alone."""

    id: str
    session_id: str
    base_name: str
    base: BaseModelSource
    model: ServedModel | None
    snapshot: dict[str, torch.Tensor] | None
    model_path: str | None
    version: int | None = None
    weights_key: Hashable | None = None  # a saved path's sampler: names its weights for the engines


@dataclass(frozen=True)
class SampleJob:
    """One checked ``asample`` call, as its job samples and answers it."""

    sampler: Sampler
    model: ServedModel | None
    tokenizer: PreTrainedTokenizerBase | None
    request: SampleRequest
    encode: Callable[[list[SampledSequence], torch.Tensor | None], Any]


def guarded(work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` with the trainer's input errors raised as the client's (:class:`UserError`)."""

    def run() -> Any:
        try:
            return work()
        except TinkerInputError as e:
            raise UserError(str(e)) from None

    return run


MODEL_ROLES = ("policy", "critic")


def model_role(body: Mapping[str, Any]) -> str:
    """The role ``create_model`` asks for: ``model_role`` in the body (SkyRL's extension, sent as
    the SDK's ``extra_body``) or in ``user_metadata`` (what the SDK's public API can send);
    ``policy`` by default.

    Raises:
        UserError: another role.
    """
    metadata = body.get("user_metadata") or {}
    role = body.get("model_role") or (metadata.get("model_role") if isinstance(metadata, dict) else None)
    role = role or "policy"
    if role not in MODEL_ROLES:
        raise UserError(f"model_role must be policy or critic, got {role!r}")
    return str(role)


class TinkerService:
    """The server's state and the calls of the Tinker API on it.

    Args:
        bases: the served base models, by the name clients send.
        checkpoint_dir: where ``tinker://`` paths are kept (``<dir>/<model_id>/<kind>/<name>``).
        loss_lookup: the losses ``forward_backward`` takes, by name.
        accept_local_dirs: also serve any local Hugging Face directory named as ``base_model``.
        max_lora_rank: the largest LoRA rank ``create_model`` accepts.
        max_samples: the most ``num_samples`` one ``asample`` may ask for.
        max_batch_rows: the most rows (``num_samples`` summed) of the ``asample`` calls queued
            back to back that are drawn as one engine request (a call with more runs alone).
        batch_wait_s: how long a sampling call waits for like calls to arrive when none is queued
            behind it (0: none).
        max_sampler_snapshots: weight snapshots kept per model for its snapshot samplers (one per
            weight version; the oldest forgotten first).
        default_max_tokens: new tokens per sample when the client sets no ``max_tokens``.
        device: where models compute.
        engines: what samples (``rollout.engine``; default: the ``hf`` engine).
    """

    def __init__(
        self,
        bases: Mapping[str, Path],
        checkpoint_dir: Path,
        loss_lookup: LossLookup,
        *,
        accept_local_dirs: bool = True,
        max_lora_rank: int = 128,
        lora_alpha: float = 32.0,
        max_samples: int = 64,
        max_batch_rows: int = 64,
        batch_wait_s: float = 0.0,
        max_sampler_snapshots: int = 16,
        default_max_tokens: int = 128,
        device: torch.device | None = None,
        engines: TinkerEngines | None = None,
    ) -> None:
        self.bases = {name: BaseModelSource(name, Path(p)) for name, p in bases.items()}
        self.checkpoint_dir = Path(checkpoint_dir)
        self.loss_lookup = loss_lookup
        self.accept_local_dirs = accept_local_dirs
        self.max_lora_rank = max_lora_rank
        self.lora_alpha = lora_alpha
        self.max_samples = max_samples
        self.max_sampler_snapshots = max_sampler_snapshots
        self.default_max_tokens = default_max_tokens
        self.device = device or torch.device("cpu")
        self.jobs = FutureTable(max_merged_rows=max_batch_rows, merge_wait_s=batch_wait_s)
        self.engines = engines or TinkerEngines(RolloutConfig())
        # sampler_weights paths saved by this process -> the weights they hold, as the engines name
        # them (a sampler of such a path samples what its engine may hold already)
        self._path_keys: dict[str, Hashable] = {}
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ServedModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._plain: dict[Path, PreTrainedModel] = {}  # base models sampled without adapters
        self._tokenizers: dict[Path, PreTrainedTokenizerBase | None] = {}
        self._lock = threading.Lock()  # the tables above, between the HTTP threads and the worker
        # one model load at a time: transformers' loading is not thread-safe (two threads loading
        # a tied-head model at once leave its head on the meta device), and the HTTP threads
        # (base-model samplers, checkpoint hosts) load beside the worker (create_model)
        self._load_lock = threading.RLock()
        self.engines.load_lock = self._load_lock  # building a sampling copy is a load too

    # ------------------------------------------------------------------ sessions
    def create_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        sid = uuid.uuid4().hex
        with self._lock:
            self.sessions[sid] = Session(sid)
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session = self._session(body.get("session_id"))
        session.last_seen_s = time.monotonic()
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str) -> dict[str, Any]:
        """End a session: its models and samplers are dropped once the jobs queued before are done
        (its checkpoints stay)."""
        session = self._session(session_id)
        session.finished = True

        def drop() -> None:
            with self._lock:
                bases = {self.models[mid].base.path for mid in session.models if mid in self.models}
                for mid in session.models:
                    self.models.pop(mid, None)
                for sid in session.samplers:
                    self.samplers.pop(sid, None)
                self.sessions.pop(session.id, None)
                still = {m.base.path for m in self.models.values()}
            for base in bases - still:  # no model of that base is left: its hf sampling copy goes
                self.engines.forget_copy(base)

        self.jobs.submit(drop)
        return {}

    def _session(self, session_id: Any) -> Session:
        with self._lock:
            session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.finished:
            raise KeyError(f"session {session_id!r} is not open on this server (create_session first)")
        return session

    # ------------------------------------------------------------------ base models
    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True} for name in sorted(self.bases)
            ]
        }

    def served_text(self) -> str:
        names = ", ".join(sorted(self.bases)) or "none by name"
        local = "; or a local Hugging Face directory path" if self.accept_local_dirs else ""
        return f"this server serves: {names}{local}"

    def resolve_base(self, name: Any) -> BaseModelSource:
        """The base model a client's ``base_model`` names.

        Raises:
            UserError: a name this server does not serve, naming those it does.
        """
        if not isinstance(name, str) or not name:
            raise UserError(f"base_model must be a model name; {self.served_text()}")
        if name in self.bases:
            return self.bases[name]
        path = Path(name)
        if self.accept_local_dirs and path.is_absolute() and (path / "config.json").is_file():
            return BaseModelSource(name, path)
        raise UserError(f"base_model {name!r} is not served here; {self.served_text()}")

    def _tokenizer(self, base: BaseModelSource) -> PreTrainedTokenizerBase | None:
        with self._load_lock:
            if base.path not in self._tokenizers:
                from openaligner.models.tokenizers import load_tokenizer

                try:
                    self._tokenizers[base.path] = load_tokenizer(base.path)
                except (OSError, ValueError):
                    self._tokenizers[base.path] = None  # ids only: stop strings are then refused
            return self._tokenizers[base.path]

    def _load_base(self, base: BaseModelSource, *, critic: bool = False) -> PreTrainedModel:
        """The base model's weights in float32 on the server's device: a causal LM, or for a critic
        a one-label sequence classifier (the backbone plus a seeded fresh head, unless the
        directory holds a value or reward model). One load at a time (``_load_lock``)."""
        with self._load_lock:
            if critic:
                from openaligner.models.critic import CriticModel

                try:
                    hf = CriticModel.from_pretrained(base.path, dtype=torch.float32).hf_model
                except ValueError as e:  # e.g. an encoder: no value per position
                    raise UserError(f"base_model {base.name!r} cannot be a critic: {e}") from None
            else:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(
                    str(base.path), local_files_only=True, dtype=torch.float32
                )
            nn.Module.to(hf, self.device)
        return hf.eval()

    def _plain_model(self, base: BaseModelSource) -> PreTrainedModel:
        with self._load_lock:  # concurrent asample calls of one base model load it once
            if base.path not in self._plain:
                self._plain[base.path] = self._load_base(base).requires_grad_(False)
            return self._plain[base.path]

    # ------------------------------------------------------------------ models
    def create_model(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session = self._session(body.get("session_id"))
        seq = body.get("model_seq_id")
        if not isinstance(seq, int):
            raise UserError("create_model needs an integer model_seq_id")
        model_id = f"{session.id}:train:{seq}"
        base = self.resolve_base(body.get("base_model"))  # refused now, naming what is served
        lora = self._lora(body.get("lora_config"))
        self._check_optimizer(body.get("optimizer_config"))
        base_name = str(body["base_model"])
        role = model_role(body)

        def work() -> dict[str, Any]:
            self._register(session, model_id, base, base_name, lora, role)
            return {"model_id": model_id, "type": "create_model"}

        return self._future(work, key=("create_model", model_id), body=body)

    def _lora(self, cfg: Any) -> TinkerLora:
        cfg = cfg or {}
        if not isinstance(cfg, dict):
            raise UserError(
                "lora_config must be an object {rank, seed, train_mlp, train_attn, train_unembed}"
            )
        rank = cfg.get("rank", 32)
        if not isinstance(rank, int) or not 1 <= rank <= self.max_lora_rank:
            raise UserError(f"lora_config.rank must be an integer in [1, {self.max_lora_rank}], got {rank!r}")
        switches = {k: cfg.get(k, True) for k in ("train_mlp", "train_attn", "train_unembed")}
        if not any(switches.values()):
            raise UserError("lora_config trains nothing: set one of train_mlp, train_attn, train_unembed")
        seed = cfg.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise UserError(f"lora_config.seed must be an integer or null, got {seed!r}")
        return TinkerLora(rank=rank, seed=seed, alpha=self.lora_alpha, **switches)

    @staticmethod
    def _check_optimizer(cfg: Any) -> None:
        if cfg is None:
            return
        kind = cfg.get("type", "adamw") if isinstance(cfg, dict) else cfg
        if kind != "adamw":
            raise UserError(f"optimizer_config type {kind!r} is not served; this server trains with adamw")

    def _register(
        self,
        session: Session,
        model_id: str,
        base: BaseModelSource,
        base_name: str,
        lora: TinkerLora,
        role: str,
    ) -> ServedModel:
        with self._lock:
            if model_id in self.models:
                raise UserError(f"model {model_id} exists already (model_seq_id used twice)")

        hf = self._load_base(base, critic=role == "critic")
        trainer = build_trained(hf, lora, role, max_tokens=position_limit(hf.config))
        served = ServedModel(model_id, session.id, base, base_name, trainer, self._tokenizer(base))
        with self._lock:
            self.models[model_id] = served
            session.models.append(model_id)
        return served

    def model(self, model_id: Any) -> ServedModel:
        with self._lock:
            served = self.models.get(model_id) if isinstance(model_id, str) else None
        if served is None:
            raise UserError(
                f"model {model_id!r} is not loaded on this server (create_model or load it first)"
            )
        return served

    def get_info(self, body: Mapping[str, Any]) -> dict[str, Any]:
        served = self.model(body.get("model_id"))
        return {
            "type": "get_info",
            "model_id": served.model_id,
            "model_data": {"model_name": served.base_name, "tokenizer_id": served.base_name},
            "is_lora": True,
            "lora_rank": served.trainer.lora.rank,
            "model_role": served.trainer.role,
            "model_name": served.base_name,
        }

    # ------------------------------------------------------------------ training
    def forward_backward(
        self,
        model_id: str,
        seq_id: int | None,
        datums: list[TinkerDatum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str],
        forward_only: bool,
        encode: Callable[[list[dict[str, torch.Tensor]], dict[str, float]], Any],
        fingerprint: bytes,
    ) -> dict[str, Any]:
        served = self.model(model_id)
        trainer = served.trainer
        if isinstance(trainer, TinkerCritic):
            trainer.check_datums(datums)
            clip = trainer.check_critic_inputs(datums, loss_fn, loss_fn_config) if not forward_only else 0.0

            def critic_work() -> Any:
                outputs, metrics = trainer.critic_forward_backward(datums, clip, forward_only=forward_only)
                return encode(outputs, metrics)

            key = ("fwdbwd", model_id, seq_id) if seq_id is not None else None
            return self._future(critic_work, key=key, raw=fingerprint)
        try:
            loss = self.loss_lookup(loss_fn)
            config = loss.resolve_config(loss_fn_config)
            served.trainer.check_datums(datums)
            for i, d in enumerate(datums):
                loss.check_inputs(
                    d.inputs, int(d.tokens.numel()), vocab_size=served.trainer.vocab_size, datum=i
                )
        except ValueError as e:  # the loss's checks: TinkerLossInputError
            raise UserError(str(e)) from None

        def work() -> Any:
            outputs, metrics = served.trainer.forward_backward(
                datums, loss, config, forward_only=forward_only
            )
            return encode(outputs, metrics)

        key = ("fwdbwd", model_id, seq_id) if seq_id is not None else None
        return self._future(work, key=key, raw=fingerprint)

    def optim_step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        served = self.model(body.get("model_id"))
        if "optimizer_params" in body:
            raise UserError("optimizer_params of another optimizer are not served; send adam_params")
        params = body.get("adam_params") or body.get("optim_params") or {}
        try:
            adam = AdamStep(**{k: float(v) for k, v in params.items() if k != "type"})
        except (TypeError, ValueError) as e:
            raise UserError(
                f"adam_params must be {{learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm}}: {e}"
            ) from None
        if (
            adam.learning_rate < 0
            or adam.grad_clip_norm < 0
            or not 0 <= adam.beta1 < 1
            or not 0 <= adam.beta2 < 1
        ):
            raise UserError(f"adam_params out of range: {params}")

        def work() -> dict[str, Any]:
            return {"metrics": served.trainer.optim_step(adam), "type": "optim_step"}

        return self._future(work, key=("optim", served.model_id, body.get("seq_id")), body=body)

    # ------------------------------------------------------------------ checkpoints
    def _path_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.checkpoint_dir / model_id / kind / name

    def parse_path(self, path: Any) -> tuple[str, str, str]:
        """``(model_id, kind, name)`` of a ``tinker://<model_id>/<weights|sampler_weights>/<name>`` path.

        Raises:
            UserError: anything else.
        """
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError(f"path must be tinker://<model_id>/weights/<name>, got {path!r}")
        parts = path[len("tinker://") :].split("/")
        if (
            len(parts) != 3
            or parts[1] not in KINDS
            or not NAME.match(parts[2])
            or not NAME.match(parts[0].replace(":", "-"))
        ):
            raise UserError(f"path must be tinker://<model_id>/weights|sampler_weights/<name>, got {path!r}")
        return parts[0], parts[1], parts[2]

    def _checkpoint_name(self, name: Any) -> str:
        if not isinstance(name, str) or not NAME.match(name):
            raise UserError(
                f"checkpoint name {name!r} must be 1-128 characters of letters, digits, '.', '_' and '-'"
            )
        return name

    def save_weights(self, body: Mapping[str, Any]) -> dict[str, Any]:
        served = self.model(body.get("model_id"))
        name = self._checkpoint_name(body.get("path") or f"step-{uuid.uuid4().hex[:8]}")
        overwrite = bool(body.get("overwrite", False))

        def work() -> dict[str, Any]:
            target = self._path_dir(served.model_id, "weights", name)
            self._write(served, target, optimizer=True, overwrite=overwrite)
            return {"path": f"tinker://{served.model_id}/weights/{name}", "type": "save_weights"}

        return self._future(work, key=("save", served.model_id, body.get("seq_id")), body=body)

    def _write(self, served: ServedModel, target: Path, *, optimizer: bool, overwrite: bool) -> None:
        if target.exists():
            if not overwrite:
                raise UserError(f"a checkpoint {target.name} of this model exists; pick another name")
            import shutil

            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        served.trainer.save(target, optimizer=optimizer, extra={"base_model": served.base_name})

    def save_weights_for_sampler(self, body: Mapping[str, Any]) -> dict[str, Any]:
        served = self.model(body.get("model_id"))
        if served.trainer.role != "policy":
            raise UserError("a critic has no sampler weights: save it with save_state (save_weights)")
        name = body.get("path")
        kind = body.get("kind", "snapshot")
        if name is not None:
            name = self._checkpoint_name(name)
        elif not isinstance(body.get("sampling_session_seq_id"), int):
            raise UserError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        if kind not in ("snapshot", "inflight"):
            raise UserError(f"kind must be snapshot or inflight, got {kind!r}")

        def work() -> dict[str, Any]:
            key = ("model", served.model_id, served.trainer.version)
            if name is not None:
                target = self._path_dir(served.model_id, "sampler_weights", name)
                self._write(served, target, optimizer=False, overwrite=False)
                path = f"tinker://{served.model_id}/sampler_weights/{name}"
                self._path_keys[path] = key
                self._push(served, key, start=False)
                return {"path": path, "type": "save_weights_for_sampler"}
            version = self._keep_snapshot(served) if kind == "snapshot" else None
            sampler_id = self._add_sampler(
                served.session_id, served.base_name, served.base, served, None, None, version=version
            )
            self._push(served, key, start=True)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        # the SDK (0.38, training_client.py) draws a new sampling_session_seq_id each time it
        # retries this seq_id, so a retry is recognised without it
        same = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
        return self._future(work, key=("save_sampler", served.model_id, body.get("seq_id")), body=same)

    def _push(self, served: ServedModel, key: Hashable, *, start: bool) -> None:
        """The model's live weights (named ``key``) into its base's vllm engine, if it samples
        through one (``start``: starting it; else only into a running one). A push that fails is
        only logged: the checkpoint or sampler stands, and the sampler's first sample pushes again
        (and fails, if it must, naming the cause)."""
        try:
            self.engines.push(served.base.path, served.trainer.model, served.tokenizer, key, start=start)
        except (RolloutEngineError, EngineSetupError) as e:
            LOGGER.warning("pushing %s's weights into its vllm engine failed: %s", served.model_id, e)

    def _keep_snapshot(self, served: ServedModel) -> int:
        """Keep the model's adapters as they are now (once per weight version) and forget the
        oldest beyond ``max_sampler_snapshots``; the version kept."""
        version = served.trainer.version
        if version not in served.snapshots:
            served.snapshots[version] = served.trainer.snapshot()
            while len(served.snapshots) > self.max_sampler_snapshots:
                served.snapshots.popitem(last=False)
        return version

    def _add_sampler(
        self,
        session_id: str,
        base_name: str,
        base: BaseModelSource,
        model: ServedModel | None,
        snapshot: dict[str, torch.Tensor] | None,
        model_path: str | None,
        *,
        version: int | None = None,
    ) -> str:
        sampler_id = f"{session_id}:sample:{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.samplers[sampler_id] = Sampler(
                sampler_id, session_id, base_name, base, model, snapshot, model_path, version
            )
            session = self.sessions.get(session_id)
            if session is not None:
                session.samplers.append(sampler_id)
        return sampler_id

    def load_weights(self, body: Mapping[str, Any]) -> dict[str, Any]:
        model_id, kind, name = self.parse_path(body.get("path"))
        directory = self._path_dir(model_id, kind, name)
        optimizer = bool(body.get("optimizer", False))
        if "session_id" in body and body.get("session_id") is not None:
            session = self._session(body.get("session_id"))
            seq = body.get("model_seq_id")
            if not isinstance(seq, int):
                raise UserError("load_weights with session_id needs an integer model_seq_id")
            target_id = f"{session.id}:train:{seq}"
            self._check_optimizer(body.get("optimizer_config"))
            base_name = body.get("base_model") or self._checkpoint_base(directory, body.get("path"))
            base = self.resolve_base(base_name)

            def create_and_load() -> dict[str, Any]:
                lora, role = read_checkpoint_lora(directory)
                served = self._register(session, target_id, base, str(base_name), lora, role)
                try:
                    served.trainer.load(directory, optimizer=optimizer)
                except BaseException:
                    with self._lock:  # a failed load leaves no model behind
                        self.models.pop(target_id, None)
                        session.models.remove(target_id)
                    raise
                return {"path": body["path"], "model_id": target_id, "type": "load_weights"}

            return self._future(create_and_load, key=("create_model", target_id), body=body)
        served = self.model(body.get("model_id"))
        if not (directory / "tinker_model.json").is_file():
            raise UserError(f"no checkpoint at {body.get('path')}")

        def load() -> dict[str, Any]:
            served.trainer.load(directory, optimizer=optimizer)
            return {"path": body["path"], "model_id": served.model_id, "type": "load_weights"}

        return self._future(load, key=("load", served.model_id, body.get("seq_id")), body=body)

    @staticmethod
    def _checkpoint_base(directory: Path, path: Any) -> str:
        try:
            return str(read_checkpoint_meta(directory)["base_model"])
        except (OSError, ValueError, KeyError):
            raise UserError(f"no checkpoint at {path} on this server") from None

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session = self._session(body.get("session_id"))
        path = body.get("model_path")
        if path is None:
            base = self.resolve_base(body.get("base_model"))
            sid = self._add_sampler(session.id, str(body["base_model"]), base, None, None, None)
            return {"type": "create_sampling_session", "sampling_session_id": sid}
        model_id, kind, name = self.parse_path(path)
        directory = self._path_dir(model_id, kind, name)
        base_name = self._checkpoint_base(directory, path)
        base = self.resolve_base(base_name)
        from safetensors.torch import load_file

        from openaligner.trainer.tinker_model import ADAPTER_FILE

        with self._lock:
            live = self.models.get(model_id)
        try:
            snapshot = load_file(str(directory / ADAPTER_FILE))
        except OSError:
            raise UserError(f"no checkpoint at {path} on this server") from None
        host = live if live is not None and set(snapshot) == set(live.trainer.params) else None
        if host is None:
            host = self._sampling_host(session, model_id, name, base, base_name, directory)
        sid = self._add_sampler(session.id, base_name, base, host, snapshot, path)
        with self._lock:
            self.samplers[sid].weights_key = self._path_keys.get(path, ("sampler", sid))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def _sampling_host(
        self,
        session: Session,
        model_id: str,
        name: str,
        base: BaseModelSource,
        base_name: str,
        directory: Path,
    ) -> ServedModel:
        """A model to sample a checkpoint whose model is not loaded (e.g. after a restart)."""
        host_id = f"{session.id}:host:{hashlib.sha1(str(directory).encode()).hexdigest()[:12]}"
        with self._lock:
            if host_id in self.models:
                return self.models[host_id]
        lora, role = read_checkpoint_lora(directory)
        if role != "policy":
            raise UserError(
                f"the checkpoint {directory.name} is a {role}'s: only a policy's weights can be sampled"
            )
        hf = self._load_base(base)
        trainer = TinkerModel(hf, lora)
        served = ServedModel(host_id, session.id, base, base_name, trainer, self._tokenizer(base))
        with self._lock:
            self.models[host_id] = served
            session.models.append(host_id)
        return served

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        with self._lock:
            sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise KeyError(f"sampler {sampler_id!r} is not open on this server")
        return {"sampler_id": sampler.id, "base_model": sampler.base_name, "model_path": sampler.model_path}

    def asample(
        self, body: Mapping[str, Any], encode: Callable[[list[SampledSequence], torch.Tensor | None], Any]
    ) -> dict[str, Any]:
        sampler = self._sampler_for(body)
        model = sampler.model
        if model is not None and model.trainer.role != "policy":
            raise UserError("this sampling session is a critic's: a value model has no tokens to sample")
        tokenizer = model.tokenizer if model is not None else self._tokenizer(sampler.base)
        vocab = model.trainer.vocab_size if model is not None else self._vocab(sampler.base)
        prompt = body.get("prompt")
        if not isinstance(prompt, dict):
            raise UserError("asample needs a prompt (a ModelInput)")
        tokens = prompt_tokens(prompt, vocab)
        params = TinkerSampling.parse(
            body.get("sampling_params") or {}, default_max_tokens=self.default_max_tokens, vocab_size=vocab
        )
        # checked here, so the client hears it as its own error, not as the engine's failure later
        limit = (
            model.trainer.max_tokens
            if model is not None
            else position_limit(self._plain_model(sampler.base).config)
        )
        if limit is not None and tokens.numel() + params.max_tokens > limit:
            raise UserError(
                f"{tokens.numel()} prompt tokens + sampling_params.max_tokens {params.max_tokens} exceed the "
                f"model's {limit} positions; lower max_tokens or shorten the prompt"
            )
        if params.stop_strings and tokenizer is None:
            raise UserError(
                "stop strings need the model's tokenizer, which its directory lacks; stop on token ids"
            )
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or not 1 <= n <= self.max_samples:
            raise UserError(f"num_samples must be an integer in [1, {self.max_samples}], got {n!r}")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise UserError(f"{key} is not served by this server; ask without it")
        for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if body.get(key) is not None:
                raise UserError(f"{key} is not served by this server; ask without it")
        if body.get("record_stability_info"):
            raise UserError("record_stability_info (for stable_reinforce) is not served by this server")
        want_prompt_lp = bool(body.get("prompt_logprobs"))
        if want_prompt_lp and tokens.numel() < 1:
            raise UserError("prompt_logprobs need a prompt")
        job = SampleJob(sampler, model, tokenizer, SampleRequest(tokens, n, params, want_prompt_lp), encode)
        # asample calls queued back to back that sample the same weights with the same settings
        # run as one engine request (futures.Merge); alone, the same code on one request
        merge = Merge(
            group=(self._weights_source(sampler, model), merge_key(params)),
            rows=n,
            item=job,
            run=self._sample_together,
        )
        ids = [uuid.uuid4().hex for _ in range(n)]
        future = self._future(lambda: self._sample_together([job])[0](), merge=merge)
        future["sample_sequence_ids"] = ids
        return future

    def _sample_together(self, jobs: Sequence[SampleJob]) -> list[Callable[[], Any]]:
        """Sample ``jobs`` (one group of :class:`~openaligner.servers.tinker.futures.Merge`: the
        same weights, the same settings but the seed) as one engine request; per job, a callable
        returning its encoded result.

        Raises:
            UserError: the engine refused the request (e.g. its ``max_model_len``), or the
                sampler's snapshot is no longer kept.
        """
        first = jobs[0]
        sampler, model, tokenizer = first.sampler, first.model, first.tokenizer
        if model is None:
            weights: Any = nullcontext(self._plain_model(sampler.base))
            key: Hashable = self._weights_source(sampler, None)
        else:
            weights = model.trainer.weights(self._sampler_weights(sampler, model))
            key = self._weights_key(sampler, model)
        try:
            with weights as hf, self.engines.engine(sampler.base.path, hf, tokenizer, key) as engine:
                outs = sample_many(engine, hf, [job.request for job in jobs], tokenizer=tokenizer)
        except RolloutEngineError as e:
            if e.status in (400, 413):  # the engine refused this request (e.g. its max_model_len)
                raise UserError(str(e)) from None
            raise
        return [
            guarded(functools.partial(job.encode, seqs, plp))
            for job, (seqs, plp) in zip(jobs, outs, strict=True)
        ]

    def _weights_source(self, sampler: Sampler, model: ServedModel | None) -> Hashable:
        """What names the weights ``sampler`` samples whenever its job runs (equal names, equal
        weights, for merging jobs queued back to back): a live sampler's model (nothing runs
        between two such jobs, so they see one version), else what :meth:`_weights_key` names."""
        if model is None:
            return ("base", str(sampler.base.path))
        if sampler.version is None and sampler.snapshot is None:
            return ("live", model.model_id)
        return self._weights_key(sampler, model)

    @staticmethod
    def _weights_key(sampler: Sampler, model: ServedModel) -> Hashable:
        """What names the weights ``sampler`` samples, for the engines (equal names, equal
        weights): a snapshot's model and version, a saved path's own key, or the live version."""
        if sampler.version is not None:
            return ("model", model.model_id, sampler.version)
        if sampler.snapshot is not None:
            return sampler.weights_key or ("sampler", sampler.id)
        return ("model", model.model_id, model.trainer.version)

    def _sampler_weights(self, sampler: Sampler, model: ServedModel) -> dict[str, torch.Tensor] | None:
        if sampler.version is None:
            return sampler.snapshot
        kept = model.snapshots.get(sampler.version)
        if kept is None:
            raise UserError(
                f"sampling session {sampler.id} sampled weights this server no longer keeps (it keeps each "
                f"model's {self.max_sampler_snapshots} latest snapshots: models.max_sampler_snapshots); "
                "create a new sampling client"
            )
        return kept

    def _vocab(self, base: BaseModelSource) -> int:
        return embedding_rows(self._plain_model(base))

    def _sampler_for(self, body: Mapping[str, Any]) -> Sampler:
        sid = body.get("sampling_session_id")
        if sid is not None:
            with self._lock:
                sampler = self.samplers.get(sid)
            if sampler is None:
                raise UserError(f"sampling session {sid!r} is not open on this server")
            return sampler
        raise UserError("asample needs a sampling_session_id (create_sampling_session first)")

    # ------------------------------------------------------------------ futures
    def _future(
        self,
        work: Callable[[], Any],
        *,
        key: tuple[Any, ...] | None = None,
        body: Mapping[str, Any] | None = None,
        raw: bytes | None = None,
        merge: Merge | None = None,
    ) -> dict[str, Any]:
        fingerprint = raw
        if body is not None:
            fingerprint = json.dumps(body, sort_keys=True, default=str).encode()
        if key is not None and key[-1] is None:
            key = None  # no seq_id: nothing to deduplicate on
        digest = hashlib.sha256(fingerprint).digest() if fingerprint is not None else None
        request_id = self.jobs.submit(guarded(work), key=key, fingerprint=digest, merge=merge)
        return {"request_id": request_id}

    def close(self) -> None:
        """Stop taking jobs (the one running finishes), then end the engines."""
        self.jobs.close()
        self.engines.close()
