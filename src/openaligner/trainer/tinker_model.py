"""One model trained through the Tinker API: LoRA adapters on a Hugging Face causal LM, gradients
accumulated across ``forward_backward`` calls, AdamW stepped by ``optim_step`` with the
parameters of each call, and its whole training state saved and restored.

Owns :class:`TinkerLora` (which layers carry adapters), :class:`TinkerModel` (forward / backward
over Tinker datums, the optimizer, weight snapshots for samplers, checkpoints) and the datum
layout (:class:`TinkerDatum`). Must not know HTTP, sessions, futures or the wire encoding; the
losses are pure functions handed in (:mod:`openaligner.algorithms.tinker_losses`).
Design notes: docs/tinker.md, "How it works".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from openaligner.models.lora import LoraConfig, add_lora

TinkerLossFn = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], tuple[torch.Tensor, torch.Tensor]
]
"""``(target_logprobs [N], loss_fn_inputs {name: [N]}, config) -> (loss summed [], elementwise [N])``."""

ATTN_NAMES = ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj", "qkv", "query", "key", "value")
MLP_NAMES = ("mlp", "ffn", "feed_forward", "gate_proj", "up_proj", "down_proj", "fc1", "fc2", "dense_h_to_4h")
LOGITS_BUDGET = 2**27
"""The most float32 logits (rows x width x vocabulary, 512 MiB) one forward of
:meth:`TinkerModel.forward_backward` builds; more datums are split into several forwards."""
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "tinker_model.json"


class TinkerInputError(ValueError):
    """A request this model cannot take (wrong shapes, ids outside the vocabulary, a missing
    input); the message names what was wrong and what was expected."""


@dataclass(frozen=True)
class TinkerLora:
    """``create_model``'s ``lora_config``: which layers carry rank-``rank`` adapters."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank


@dataclass(frozen=True)
class TinkerDatum:
    """One datum: ``tokens`` [N] int64 (the model input) and ``inputs`` {name: [N]} (the loss's
    inputs, position ``i`` about the token predicted after ``tokens[:i+1]``)."""

    tokens: torch.Tensor
    inputs: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class AdamStep:
    """``optim_step``'s AdamW parameters (decoupled weight decay; ``grad_clip_norm`` 0: none)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def lora_targets(model: nn.Module, lora: TinkerLora) -> list[str]:
    """Names (last component) of the linear layers that get adapters under ``lora``'s switches;
    the output head only with ``train_unembed``.

    Raises:
        TinkerInputError: the switches select no layer of this model.
    """
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    names: set[str] = set()
    for full, module in model.named_modules():
        if not isinstance(module, nn.Linear | Conv1D):
            continue
        leaf = full.rsplit(".", 1)[-1]
        lowered = full.lower()
        if module is head:
            if lora.train_unembed:
                names.add(leaf)
        elif any(n in lowered for n in ATTN_NAMES):
            if lora.train_attn:
                names.add(leaf)
        elif any(n in lowered for n in MLP_NAMES) and lora.train_mlp:
            names.add(leaf)
    if not names:
        raise TinkerInputError(
            "lora_config selects no layer of this model: set at least one of train_attn, train_mlp, "
            "train_unembed to true"
        )
    return sorted(names)


def embedding_rows(model: PreTrainedModel) -> int:
    """How many token ids ``model`` embeds (its input embedding's rows: the valid ids)."""
    weight = getattr(model.get_input_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(model).__name__} has no input embedding table")
    return int(weight.shape[0])


class TinkerModel:
    """A trainable LoRA model behind the Tinker API.

    Args:
        base: the base causal LM (its weights stay frozen; adapters go on it in place).
        lora: which layers get adapters, their rank and init seed.
        max_tokens: longest datum accepted (the model's positions).

    Gradients of every ``forward_backward`` since the last :meth:`optim_step` add up in the
    parameters' ``.grad`` (Tinker's losses are sums, so several calls equal one call on all
    their datums). :attr:`version` counts the changes of the weights (steps and loads).
    """

    role = "policy"

    def __init__(self, base: PreTrainedModel, lora: TinkerLora, *, max_tokens: int | None = None) -> None:
        if lora.rank < 1:
            raise TinkerInputError(f"lora_config.rank must be >= 1, got {lora.rank}")
        targets = lora_targets(base, lora)
        self.vocab_size = embedding_rows(base)
        with torch.random.fork_rng(devices=[]):
            if lora.seed is not None:
                torch.manual_seed(lora.seed)
            self.model: Any = self._adapt(
                base, LoraConfig(r=lora.rank, alpha=lora.alpha, target_modules=targets)
            )
        self.model.eval()  # no dropout: the log-probs a forward reports are those it trains on
        self.lora = lora
        self.targets = targets
        self.max_tokens = max_tokens
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=0.0, foreach=False)
        self.version = 0
        self.steps = 0
        self.pending_datums = 0  # datums whose gradients wait for the next optim_step

    def _adapt(self, base: PreTrainedModel, cfg: LoraConfig) -> Any:
        return add_lora(base, cfg)

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    # ------------------------------------------------------------------ checks
    def check_datums(self, datums: list[TinkerDatum]) -> None:
        """Refuse model inputs the model cannot take, before any datum is computed (the loss
        checks its own inputs).

        Raises:
            TinkerInputError: an empty list, a datum without tokens or longer than the model's
                positions, or token ids outside the vocabulary.
        """
        if not datums:
            raise TinkerInputError("forward_backward needs at least one datum")
        for i, d in enumerate(datums):
            n = int(d.tokens.numel())
            if d.tokens.dim() != 1 or n == 0:
                raise TinkerInputError(f"datum {i}: model_input must hold at least one token")
            if self.max_tokens is not None and n > self.max_tokens:
                raise TinkerInputError(
                    f"datum {i}: {n} tokens, more than this model's {self.max_tokens} positions"
                )
            low, high = int(d.tokens.min()), int(d.tokens.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise TinkerInputError(
                    f"datum {i}: model_input token id {bad} is outside the model's vocabulary "
                    f"[0, {self.vocab_size})"
                )

    # ------------------------------------------------------------------ compute
    def target_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(targets[i] | tokens[:i+1]) for one datum: [N] for targets [N], [N, K] for
        targets [N, K] (cross_entropy's top-K form); with gradient when enabled."""
        return self.batch_logprobs([tokens], [targets])[0]

    def batch_logprobs(self, tokens: list[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`target_logprobs` of several datums in one forward: right-padded (a causal
        model's position ``i`` never sees later positions, so the padding changes nothing)."""
        width = max(int(t.numel()) for t in tokens)
        batch = torch.zeros(len(tokens), width, dtype=torch.long)
        for row, t in enumerate(tokens):
            batch[row, : t.numel()] = t
        logits = self.model(input_ids=batch.to(self.device)).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for row, (t, target) in enumerate(zip(tokens, targets, strict=True)):
            n = int(t.numel())
            index = target.to(self.device).long()
            picked = logprobs[row, :n].gather(-1, index if index.dim() == 2 else index[:, None])
            out.append(picked if index.dim() == 2 else picked[:, 0])
        return out

    def micro_batches(self, datums: list[TinkerDatum]) -> list[list[TinkerDatum]]:
        """``datums`` in order, split so that one forward's float32 logits stay under
        :data:`LOGITS_BUDGET` elements (rows x width x vocabulary)."""
        out: list[list[TinkerDatum]] = []
        current: list[TinkerDatum] = []
        for d in datums:
            candidate = [*current, d]
            width = max(int(x.tokens.numel()) for x in candidate)
            if current and len(candidate) * width * self.vocab_size > LOGITS_BUDGET:
                out.append(current)
                candidate = [d]
            current = candidate
        if current:
            out.append(current)
        return out

    @contextmanager
    def _all_or_nothing(self, forward_only: bool) -> Iterator[None]:
        """The gradients pending before a ``forward_backward`` call, put back when the call fails
        (nothing to keep for ``forward_only``, which adds none)."""
        saved = None
        if not forward_only:
            saved = {n: None if p.grad is None else p.grad.clone() for n, p in self.params.items()}
        try:
            yield
        except BaseException:
            if saved is not None:
                for n, p in self.params.items():
                    p.grad = saved[n]
            raise

    def forward_backward(
        self,
        datums: list[TinkerDatum],
        loss: TinkerLossFn,
        config: Mapping[str, float],
        *,
        forward_only: bool,
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Each datum's ``logprobs`` [N] and ``elementwise_loss`` [N], and the metrics
        (``loss:sum``); without ``forward_only`` the loss's gradient is added to the pending ones.

        All-or-nothing: when a datum fails, the gradients of this call are taken back, so the
        pending ones stay those of the earlier calls.
        """
        outputs: list[dict[str, torch.Tensor]] = []
        total = 0.0
        with self._all_or_nothing(forward_only), torch.set_grad_enabled(not forward_only):
            for group in self.micro_batches(datums):
                lps = self.batch_logprobs(
                    [d.tokens for d in group], [d.inputs["target_tokens"] for d in group]
                )
                summed_group = []
                for d, lp in zip(group, lps, strict=True):
                    inputs = {k: v.to(lp.device) for k, v in d.inputs.items()}
                    summed, elementwise = loss(lp, inputs, config)
                    summed_group.append(summed)
                    total += float(summed.detach())
                    outputs.append(
                        {
                            "logprobs": lp.detach().float().cpu(),
                            "elementwise_loss": elementwise.detach().float().cpu(),
                        }
                    )
                if not forward_only:
                    torch.stack(summed_group).sum().backward()
        if not forward_only:
            self.pending_datums += len(datums)
        return outputs, {"loss:sum": total}

    def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last one (none: the weights still
        decay and Adam's moments still age, as a step on zero gradients), then clear them."""
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        params = list(self.params.values())
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        if adam.grad_clip_norm > 0 and math.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, torch.tensor(norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.steps += 1
        datums, self.pending_datums = self.pending_datums, 0
        return {"optim/grad_norm": norm, "optim/learning_rate": adam.learning_rate, "optim/datums": datums}

    # ------------------------------------------------------------------ weights
    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the trained tensors (the adapters) as they are now, for a sampler."""
        return {n: p.detach().clone() for n, p in self.params.items()}

    @contextmanager
    def weights(self, snapshot: Mapping[str, torch.Tensor] | None) -> Iterator[PreTrainedModel]:
        """Inside, the model computes with ``snapshot``'s adapters (None: the live ones); the live
        ones are back afterwards. Only one thread may use the model at a time."""
        if snapshot is None:
            yield self.model
            return
        live = self.snapshot()
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(snapshot[n])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(live[n])

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path, *, optimizer: bool, extra: Mapping[str, str] | None = None) -> None:
        """Write the adapters (and, with ``optimizer``, AdamW's state) into ``directory``, with
        ``extra`` in its metadata (e.g. the base model's name), atomically: a crash leaves either
        the whole checkpoint or none (written beside, renamed)."""
        final = Path(directory)
        tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous().cpu() for n, t in self.snapshot().items()}, str(tmp / ADAPTER_FILE))
        meta = {
            **(extra or {}),
            "lora": asdict(self.lora),
            "targets": self.targets,
            "steps": self.steps,
            "role": self.role,
        }
        if optimizer:
            names = list(self.params)
            state = self.optimizer.state_dict()
            torch.save({"names": names, "state": state}, tmp / OPTIMIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            raise FileExistsError(f"{final} exists")
        os.replace(tmp, final)
        parent = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(parent)  # the rename itself survives a crash
        finally:
            os.close(parent)

    def load(self, directory: str | Path, *, optimizer: bool) -> None:
        """Take the adapters (and with ``optimizer`` AdamW's state) saved by :meth:`save`.

        Raises:
            TinkerInputError: the checkpoint's adapters do not fit this model, or it has no
                optimizer state and ``optimizer`` asks for it.
        """
        d = Path(directory)
        tensors = load_file(str(d / ADAPTER_FILE))
        if set(tensors) != set(self.params) or any(
            tensors[n].shape != p.shape for n, p in self.params.items()
        ):
            raise TinkerInputError(
                f"the checkpoint {d.name} holds adapters of another shape than this model's (rank "
                f"{self.lora.rank} on {', '.join(self.targets)})"
            )
        opt_state = None
        if optimizer:
            if not (d / OPTIMIZER_FILE).is_file():
                raise TinkerInputError(
                    f"the checkpoint {d.name} holds no optimizer state (a save_weights_for_sampler one?); "
                    "load it without the optimizer, or save it with save_state"
                )
            opt_state = torch.load(d / OPTIMIZER_FILE, weights_only=True)
        meta = json.loads((d / META_FILE).read_text())  # read all before anything is written
        # the weights change from the first copy on: a new version even if a later line raises, so
        # nothing that names weights by version (a sampler's merged copy) keeps the old ones
        self.version += 1
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors[n])
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state["state"])
        self.steps = int(meta.get("steps", 0))
        for p in self.params.values():
            p.grad = None
        self.pending_datums = 0


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The metadata :meth:`TinkerModel.save` wrote (``extra``'s keys among them)."""
    meta: dict[str, Any] = json.loads((Path(directory) / META_FILE).read_text())
    return meta


def read_checkpoint_lora(directory: str | Path) -> tuple[TinkerLora, str]:
    """The :class:`TinkerLora` and role (``policy`` or ``critic``) a checkpoint was saved with
    (to rebuild its model on load)."""
    meta = json.loads((Path(directory) / META_FILE).read_text())
    return TinkerLora(**meta["lora"]), str(meta.get("role", "policy"))


CRITIC_LOSS = "ppo"
"""The ``loss_fn`` a critic trains with: the SDK's names have no value loss, so a critic takes
``ppo`` (as SkyRL's extension does) and reads it as the clipped value loss."""
VALUE_CLIP = 0.2
"""The value clip of the critic's loss when ``loss_fn_config`` sets no ``value_clip`` (the critic
server's ``train.loss_clip_val``)."""
CRITIC_INPUTS = ("values", "returns", "mask")


class TinkerCritic(TinkerModel):
    """A value model behind the Tinker API (``create_model`` with ``model_role: critic``): the
    base model's backbone with LoRA adapters and a fresh scalar head (trained in full) read at
    every position (:class:`~openaligner.models.critic.CriticModel`).

    ``forward`` returns each datum's ``values`` [N]; ``forward_backward`` with ``loss_fn="ppo"``
    takes ``values`` (the rollout's, the clip's centre), ``returns`` and ``mask`` [N] and adds the
    gradient of the clipped value loss of the critic server,
    ``0.5 · Σ mask · max((V_clip − R)², (V − R)²)`` with ``V_clip = old + clip(V − old, ±value_clip)``
    — summed over tokens and datums like every Tinker loss (not a mean).
    """

    role = "critic"

    def _adapt(self, base: PreTrainedModel, cfg: LoraConfig) -> Any:
        from openaligner.models.critic import CriticModel
        from openaligner.models.lora import add_lora

        return add_lora(CriticModel(base), cfg)

    def check_critic_inputs(
        self, datums: list[TinkerDatum], loss_fn: str, config: Mapping[str, Any]
    ) -> float:
        """The value clip, after checking the datums' inputs.

        Raises:
            TinkerInputError: another loss, unknown config keys, a missing input or one of another
                length than the datum's tokens.
        """
        if loss_fn != CRITIC_LOSS:
            raise TinkerInputError(
                f"a critic trains with loss_fn={CRITIC_LOSS!r} (the clipped value loss), got {loss_fn!r}"
            )
        unknown = sorted(set(config) - {"value_clip"})
        if unknown:
            raise TinkerInputError(f"loss_fn_config for a critic takes only value_clip, got {unknown}")
        clip = config.get("value_clip", VALUE_CLIP)
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not math.isfinite(clip) or clip < 0:
            raise TinkerInputError(f"loss_fn_config value_clip must be >= 0 (0: no clipping), got {clip}")
        for i, d in enumerate(datums):
            n = int(d.tokens.numel())
            for name in CRITIC_INPUTS:
                t = d.inputs.get(name)
                if t is None:
                    raise TinkerInputError(
                        f"datum {i}: a critic's loss_fn_inputs need {', '.join(CRITIC_INPUTS)}; "
                        f"{name!r} is missing"
                    )
                if t.shape != (n,) or not t.dtype.is_floating_point or not bool(torch.isfinite(t).all()):
                    raise TinkerInputError(
                        f"datum {i}: loss_fn_inputs[{name!r}] must be [{n}] finite floats (one per "
                        f"model_input token), got shape {list(t.shape)} {t.dtype}"
                    )
        return float(clip)

    def values(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] V(tokens[:i+1]) for one datum, with gradient when enabled."""
        out: torch.Tensor = self.model(tokens.to(self.device)[None])[0]
        return out.float()

    def critic_forward_backward(
        self, datums: list[TinkerDatum], clip: float, *, forward_only: bool
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Each datum's ``values`` (and, when trained, ``elementwise_loss``) and ``loss:sum``;
        all-or-nothing as :meth:`TinkerModel.forward_backward`."""
        from openaligner.algorithms import value_loss

        outputs: list[dict[str, torch.Tensor]] = []
        total = 0.0
        with self._all_or_nothing(forward_only), torch.set_grad_enabled(not forward_only):
            for d in datums:
                v = self.values(d.tokens)
                out = {"values": v.detach().cpu()}
                if not forward_only or all(k in d.inputs for k in CRITIC_INPUTS):
                    old, ret, mask = (d.inputs[k].to(v.device).float() for k in CRITIC_INPUTS)
                    loss, _ = value_loss(v[None], old[None], ret[None], mask[None], clip, units=1.0)
                    if not forward_only:
                        loss.backward()
                    total += float(loss.detach())
                outputs.append(out)
        if not forward_only:
            self.pending_datums += len(datums)
        return outputs, {"loss:sum": total}


def build_trained(
    base: PreTrainedModel, lora: TinkerLora, role: str, *, max_tokens: int | None
) -> TinkerModel:
    """A :class:`TinkerModel` (``policy``) or :class:`TinkerCritic` (``critic``) on ``base``."""
    if role == "critic":
        return TinkerCritic(base, lora, max_tokens=max_tokens)
    return TinkerModel(base, lora, max_tokens=max_tokens)
