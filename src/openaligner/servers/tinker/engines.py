"""The rollout engines ``asample`` draws through (``rollout.engine``): ``hf`` over a merged plain
copy of the model per base (the adapters merged in; a base-model sampler: the plain model itself),
or ``vllm``: one engine process per base model. Either holds one set of weights at a time, shared
by every model and sampler of that base, and takes another when a sampler of other weights samples.

Owns :class:`TinkerEngines` (which engine, which weights each copy or vllm engine holds,
restarting a dead one). Must not know HTTP, sessions or the samplers' bookkeeping; the engines
are ``rollout/``'s.
Design notes: docs/tinker.md, "Sampling engines".
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openaligner.rollout.config import RolloutConfig
from openaligner.rollout.engine import RolloutEngine, RolloutEngineError

LOGGER = logging.getLogger(__name__)


class MergedWeights:
    """A :class:`~openaligner.rollout.engine.WeightSource` over a Tinker model's modules as they
    are when the engine reads them: the adapters merged, an adapted tied head kept apart
    (:func:`~openaligner.models.lora.merged_state_dict`)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def inference_state_dict(self) -> dict[str, torch.Tensor]:
        from openaligner.models.lora import merged_state_dict

        return merged_state_dict(self.model)


def plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain model of ``model``'s architecture (LoRA looked through) on its device, in its
    dtype, in eval mode, with a head of its own even where ``model``'s config ties it to the
    embedding (an adapter on a tied head makes the two differ). Its weights are not set: load
    :func:`~openaligner.models.lora.merged_state_dict` of ``model`` into it."""
    from openaligner.models.lora import unwrap

    inner: Any = unwrap(model)
    config = copy.deepcopy(inner.config)
    config.tie_word_embeddings = False
    first = next(inner.parameters())
    with torch.device(first.device):
        plain = type(inner)._from_config(config, dtype=first.dtype)
    return cast(PreTrainedModel, plain.eval().requires_grad_(False))


EngineFactory = Callable[[RolloutConfig, PreTrainedModel, PreTrainedTokenizerBase | None], RolloutEngine]
"""``(rollout section, the model in its sampler's weights, tokenizer) -> a new vllm engine`` (not
started); replaced by tests with a fake."""


def _vllm_engine(
    cfg: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None
) -> RolloutEngine:
    from openaligner.models.actor import CausalLMActor
    from openaligner.rollout.vllm_engine import VLLMRolloutEngine

    # its own head: a LoRA adapter on a tied head (train_unembed) makes head and embedding differ
    return VLLMRolloutEngine(CausalLMActor(model, tokenizer, init_policy=False), cfg.vllm, untie_head=True)


class TinkerEngines:
    """The engines of one server.

    Args:
        cfg: the ``rollout`` section (``engine`` hf or vllm, ``vllm.*`` the vllm engine's keys).
        vllm_factory: builds a vllm engine (default: a ``VLLMRolloutEngine`` with its own head).

    Every method runs on the server's one worker thread (the futures' jobs), so a push never reads
    weights an optimizer step is writing, and an engine never generates while its weights change:
    a push is written whole (renamed into place) and reloaded before the next generate starts.
    """

    def __init__(self, cfg: RolloutConfig, vllm_factory: EngineFactory = _vllm_engine) -> None:
        self.cfg = cfg
        self.factory = vllm_factory
        self.vllm: dict[Path, RolloutEngine] = {}  # base model directory -> its engine
        self.holds: dict[Path, Hashable] = {}  # base model directory -> the weights its engine holds
        self.pushes = 0  # weight sets handed to vllm engines (their version numbers)
        self.copies: dict[Path, PreTrainedModel] = {}  # hf: base model directory -> its merged copy
        self.copy_holds: dict[Path, Hashable] = {}  # base model directory -> the weights its copy holds
        self.merges = 0  # weight sets merged into hf copies
        # held while a copy is built: transformers' model construction swaps process-wide state
        # (default dtype, init functions), so it must not overlap a load on another thread; the
        # service puts its own load lock here
        self.load_lock: Any = threading.RLock()

    @property
    def name(self) -> str:
        return self.cfg.engine

    def _vllm_for(
        self, base: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, key: Hashable
    ) -> RolloutEngine:
        engine = self.vllm.get(base)
        if engine is None:
            engine = self.vllm[base] = self.factory(self.cfg, model, tokenizer)
        if self.holds.get(base) != key:
            self.pushes += 1
            engine.update_weights(MergedWeights(model), self.pushes)  # pushed at the next generate
            self.holds[base] = key
        return engine

    def _copy_for(self, base: Path, model: PreTrainedModel, key: Hashable) -> PreTrainedModel:
        """``model`` itself when it has no adapters; else the base's plain copy, holding
        ``model``'s merged weights (merged again only when ``key`` differs from what it holds)."""
        from openaligner.models.lora import is_peft_model, merged_state_dict

        if not is_peft_model(model):
            return model
        plain = self.copies.get(base)
        if plain is None:
            with self.load_lock:
                plain = self.copies[base] = plain_copy(model)
        if self.copy_holds.get(base) != key:
            self.copy_holds.pop(base, None)  # a load that fails midway leaves the copy holding nothing
            with torch.no_grad():
                plain.load_state_dict(merged_state_dict(model), strict=True)
            self.copy_holds[base] = key
            self.merges += 1
        return plain

    @contextmanager
    def engine(
        self, base: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, key: Hashable
    ) -> Iterator[RolloutEngine]:
        """The engine to sample ``model`` (its modules holding the sampler's weights, named by
        ``key``: equal keys are equal weights) of base directory ``base``, for one call.

        hf: a fresh :class:`~openaligner.rollout.hf_engine.HFRolloutEngine`, each row drawn from
        its own seed's stream (as vllm draws them), over the base's merged copy of ``model``
        (re-merged when it holds other weights than ``key``; the unmerged adapters' forward costs
        about twice the plain one's) or, without adapters, over ``model`` itself. Score with
        ``model``: the copy's logits equal its to float rounding only. vllm:
        the base's engine, told to take ``model``'s weights when it holds others. When the call
        fails, what the engine holds is forgotten (the next call pushes again); an engine that
        failed other than by refusing a request (it died, timed out) is stopped and dropped, and
        the next call starts a new one.
        """
        if self.cfg.engine == "hf":
            from openaligner.models.actor import CausalLMActor
            from openaligner.rollout.hf_engine import HFRolloutEngine

            plain = self._copy_for(base, model, key)
            # a stream per row: a seeded request samples alike alone or merged with others
            yield HFRolloutEngine(CausalLMActor(plain, tokenizer, init_policy=False), per_row_streams=True)
            return
        engine = self._vllm_for(base, model, tokenizer, key)
        try:
            yield engine
        except RolloutEngineError as e:
            self.holds.pop(base, None)
            if e.status is None:  # not a refusal of one request: the engine is not to be trusted
                LOGGER.error("the vllm engine of %s failed (%s): it is restarted at the next call", base, e)
                self.vllm.pop(base, None)
                engine.close()
            raise
        except BaseException:
            self.holds.pop(base, None)
            raise

    def push(
        self,
        base: Path,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        key: Hashable,
        *,
        start: bool,
    ) -> bool:
        """Hand ``model``'s weights (named ``key``) to the vllm engine of ``base`` now, starting it
        when ``start`` (else only into an engine that runs); whether a push happened. hf: nothing
        pushed (its copy is merged at the next sample of other weights)."""
        if self.cfg.engine == "hf" or (not start and base not in self.vllm):
            return False
        with self.engine(base, model, tokenizer, key) as engine:
            engine.sync_weights()
        return True

    def forget_copy(self, base: Path) -> None:
        """Free the hf sampling copy of ``base`` (its models are gone; a later one builds it again)."""
        self.copies.pop(base, None)
        self.copy_holds.pop(base, None)

    def close(self) -> None:
        """End every engine (their processes and directories) and drop the hf copies."""
        self.copies, self.copy_holds = {}, {}
        engines, self.vllm, self.holds = list(self.vllm.values()), {}, {}
        for engine in engines:
            try:
                engine.close()
            except Exception:  # one engine's failure to stop must not leave the others running
                LOGGER.exception("a vllm engine did not stop cleanly")
