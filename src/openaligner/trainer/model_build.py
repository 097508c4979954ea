"""One model build for every command: load → vocabulary check → LoRA → distribute → fill from rank 0.

Owns that order and the start-up refusals of its steps (:class:`~openaligner.config.StartupError`).
Must not know which command builds, where the model comes from (the caller's loader) or what is
done with the model afterwards (optimizers, servers, the PPO loop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Protocol, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openaligner.config import as_startup_error
from openaligner.models.critic import CriticModel
from openaligner.models.lora import LoraConfig, LoraError, add_lora
from openaligner.models.reward import RewardModel, ScalarHeadModel
from openaligner.models.sharding import (
    ParallelConfig,
    ShardingError,
    builds_skeleton,
    distribute,
    fill_from_leader,
    shard,
    state_to_share,
)
from openaligner.models.source import SourceError, check_vocab
from openaligner.trainer.startup import starting

M = TypeVar("M", PreTrainedModel, RewardModel, CriticModel)
M_co = TypeVar("M_co", covariant=True)

SharedState = Mapping[str, torch.Tensor] | None
"""Rank 0's whole state dict of a model about to be sharded (None elsewhere, or unsharded)."""


class ModelLoader(Protocol[M_co]):
    """Reads (or draws) a model onto ``device``; with ``skeleton`` builds it on the meta device
    instead (see :func:`~openaligner.models.source.load_causal_lm`). E.g.
    ``partial(load_causal_lm, source, vocab_size, dtype=MASTER_DTYPE)``."""

    def __call__(self, device: torch.device, /, *, skeleton: bool) -> M_co: ...


def build_trainable_model(
    load: ModelLoader[M],
    parallel: ParallelConfig,
    device: torch.device,
    *,
    name: str,
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_key: str = "model",
    vocab_fix: str | None = None,
    loading: str | None = None,
    lora: LoraConfig | None = None,
    lora_seed: int | None = None,
    rank_seed: int | None = None,
    before_sharding: Callable[[M, SharedState], None] | None = None,
) -> M:
    """The model every command holds, laid over the ranks and ready for an optimizer.

    In order: ``load`` it (onto ``parallel.load_device(device)``; as a skeleton on every rank but
    0 of a sharded run, :func:`~openaligner.models.sharding.builds_skeleton`); refuse a
    ``tokenizer`` with ids it cannot embed; add ``lora``'s adapters; call ``before_sharding``
    (e.g. to copy the PPO initial policy); shard it as ``parallel`` says; and give every rank its
    shards of rank 0's weights. A collective when ``parallel`` shards (every rank calls it with
    the same arguments); otherwise local. A frozen model (a served reward model) comes from a
    loader that freezes it, with no ``lora``.

    Args:
        load: reads the model (see :class:`ModelLoader`), in the dtype the caller wants (float32
            masters for a trained model); a causal LM, reward model or critic.
        parallel: the command's ``parallel`` section.
        device: this rank's device (the model is read onto the CPU first when it will be sharded).
        name: what the model is, in sharding messages (``model``, ``reward model``, ``actor``, ...).
        tokenizer: the ids the model will read (None: no check, e.g. a server without a tokenizer).
        vocab_key, vocab_fix: the model's config key and the advice in the vocabulary refusal
            (:func:`~openaligner.models.source.check_vocab`).
        loading: logged as ``loading <loading> onto <device>…`` with the time it took (rank 0;
            None: nothing logged).
        lora: the ``lora`` section (None or ``r = 0``: no adapters).
        lora_seed: seeds the global RNG right before the adapters are drawn (None: as the caller
            left it, e.g. seeded once at the start of a training run).
        rank_seed: after sharding, each rank draws from ``rank_seed + rank`` (more than one rank;
            :func:`~openaligner.models.sharding.distribute`); None: the RNG is left as it is.
        before_sharding: sees the model with its adapters and rank 0's state to share (None
            elsewhere), before the model is sharded.

    Returns:
        The model (its class changed and parameters sharded under ``fsdp``), in the mode ``load``
        left it.

    Raises:
        StartupError: the tokenizer has ids the model cannot embed, the adapters cannot be added,
            or ``parallel`` cannot shard the model.
    """
    load_device = parallel.load_device(device)  # sharded: read on the CPU, shards go to the device
    announced = starting(f"loading {loading} onto {load_device}") if loading is not None else nullcontext()
    with as_startup_error(SourceError):
        with announced:
            model = load(load_device, skeleton=builds_skeleton(parallel))
        if tokenizer is not None:
            hf_model = model.hf_model if isinstance(model, ScalarHeadModel) else model
            check_vocab(tokenizer, hf_model, key=vocab_key, fix=vocab_fix)
    if lora is not None:
        if lora_seed is not None:
            # peft draws the adapters from the global RNG: seeded, every rank and every start
            # draws the same adapters
            torch.manual_seed(lora_seed)
        with as_startup_error(LoraError):
            model = add_lora(model, lora)  # r = 0: the model as it is
    state = state_to_share(model, parallel)  # rank 0's weights for the other ranks' skeletons
    if before_sharding is not None:
        before_sharding(model, state)
    with as_startup_error(ShardingError):  # after LoRA, before the optimizer (sharding replaces parameters)
        if rank_seed is not None:
            model = distribute(model, parallel, rank_seed, name=name)
        else:
            model = shard(model, parallel, name=name)
    fill_from_leader(model, state, parallel, offload=parallel.offload)
    return model
