"""The losses of the Tinker training API, exactly as Tinker defines them: plain SUMS over a
datum's tokens and over datums (no means), so gradients add across ``forward_backward`` calls.

Owns: one pure function per supported loss, ``fn(target_logprobs, inputs, config) -> (loss,
elementwise)``; the registry of names (refusing, never approximating, the losses we do not
implement); the checks of ``loss_fn_inputs`` / ``loss_fn_config`` per loss; the metric-key
convention ``"name:reduction"``. Inputs are next-token aligned with the datum's N model-input
tokens: lp = target_logprobs [N], q = inputs["logprobs"], A = inputs["advantages"].
Must not know: models, the wire format, HTTP, optimizers. Imports torch and the stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

LossFn = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], tuple[torch.Tensor, torch.Tensor]
]

# Defaults of the clip thresholds, from Tinker's loss pages: PPO's ε is "currently fixed to 0.2"
# (ratio bounds 0.8 and 1.2); CISPO "defaults to disabling the lower bound and only capping the
# upper side (clip_low_threshold=0.0, clip_high_threshold=4.0)". DRO's beta has no published
# default, so the server asks for it rather than guess one.
PPO_CLIP_LOW = 0.8
PPO_CLIP_HIGH = 1.2
CISPO_CLIP_LOW = 0.0
CISPO_CLIP_HIGH = 4.0

# The reductions the SDK knows when it folds the metrics of several chunks of one call
# (a key "name:reduction"; another suffix is dropped by the client, a key without exactly one
# colon makes it raise ValueError).
METRIC_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "min", "max", "slack", "hash2", "unique")
# The one metric every Tinker loss reports: the summed loss of the call's datums.
LOSS_METRIC = "loss:sum"

# Loss names the SDK can send (tinker.types.LossFnType) that this module refuses, and why.
REFUSED_LOSSES: Mapping[str, str] = {
    "stable_reinforce": (
        "its objective is not published, and it needs per-sample stability records kept by the "
        "sampler (record_stability_info) that this server does not keep"
    ),
    "gspo": "Tinker does not publish its exact objective (sequence-level ratio and clipping)",
    "custom": (
        "server-side custom losses are not implemented; the SDK runs forward_backward_custom on "
        "the client (through cross_entropy) as long as client/config leaves "
        "custom_loss_server_side false"
    ),
}


class TinkerLossInputError(ValueError):
    """A datum's ``loss_fn_inputs`` or the call's ``loss_fn_config`` does not fit the loss.

    The message names the loss, the datum, the key and what was expected.
    """


# -- the losses ---------------------------------------------------------------------------------


def cross_entropy(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted negative log-likelihood: L = Σ −lp·w (Tinker: "Backend CE is
    L = sum(-logprobs * weights)").

    ``target_logprobs`` and ``inputs["weights"]`` are [N], or [N, K] for Tinker's top-K
    distillation (K candidate targets per position, each with its weight). Weights are any
    floats: the SDK's ``forward_backward_custom`` sends w = −dC/dlp through this loss.

    Worked example: lp = [−0.5, −1.0, −2.0], w = [0, 1, 1] →
    elementwise = [−(−0.5)·0, −(−1.0)·1, −(−2.0)·1] = [0, 1, 2], loss = 3.
    """
    del config
    elementwise = -target_logprobs * inputs["weights"].to(target_logprobs.dtype)
    return elementwise.sum(), elementwise


def importance_sampling(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with an importance-sampling correction: L = −Σ exp(lp − q)·A.

    Its gradient is −A·exp(lp − q)·∇lp. No weights: a client masks a token with A = 0 (the
    cookbook does so for prompt tokens, with q = 0).

    Worked example: lp = [−1, −0.5, −2], q = [−1, −1, −2], A = [0, 2, −1] →
    ratio = [e⁰, e^0.5, e⁰] = [1, 1.6487, 1]; elementwise = [−0, −3.2974, 1]; loss = −2.2974.
    """
    del config
    ratio = torch.exp(target_logprobs - _float(inputs["logprobs"], target_logprobs))
    elementwise = -ratio * _float(inputs["advantages"], target_logprobs)
    return elementwise.sum(), elementwise


def ppo(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate of PPO (Schulman et al. 2017), token-wise and summed:
    r = exp(lp − q), L = −Σ min(r·A, clip(r, low, high)·A).

    ``low`` / ``high`` are ratio bounds (not ε): ``config["clip_low_threshold"]`` (default 0.8)
    and ``config["clip_high_threshold"]`` (default 1.2). Inside [low, high] the loss and its
    gradient are importance_sampling's; outside, on the side the advantage pushes towards, the
    token's gradient is 0.

    Worked example (defaults): r = [1, 1.5, 0.5], A = [1, 1, −1] →
    r·A = [1, 1.5, −0.5]; clip(r)·A = [1, 1.2, −0.8]; min = [1, 1.2, −0.8];
    elementwise = [−1, −1.2, 0.8]; loss = −1.4.
    """
    low = config.get("clip_low_threshold", PPO_CLIP_LOW)
    high = config.get("clip_high_threshold", PPO_CLIP_HIGH)
    ratio = torch.exp(target_logprobs - _float(inputs["logprobs"], target_logprobs))
    advantages = _float(inputs["advantages"], target_logprobs)
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    elementwise = -objective
    return elementwise.sum(), elementwise


def cispo(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025): the clipped ratio as a stop-gradient coefficient on
    the log-likelihood: L = −Σ sg(clip(r, low, high))·lp·A, r = exp(lp − q).

    The gradient is −sg(clip(r))·A·∇lp: it flows through lp only, and no token's gradient is
    ever zeroed. Bounds from ``config["clip_low_threshold"]`` (default 0.0) and
    ``config["clip_high_threshold"]`` (default 4.0), Tinker's one-sided default.

    Worked example (defaults): lp = [−1, −0.5, −2], r = [1, 5, 0.5], A = [1, 1, −1] →
    clip(r) = [1, 4, 0.5]; elementwise = −[1·(−1)·1, 4·(−0.5)·1, 0.5·(−2)·(−1)] = [1, 2, −1];
    loss = 2.
    """
    low = config.get("clip_low_threshold", CISPO_CLIP_LOW)
    high = config.get("clip_high_threshold", CISPO_CLIP_HIGH)
    ratio = torch.exp(target_logprobs - _float(inputs["logprobs"], target_logprobs))
    coefficient = ratio.clamp(low, high).detach()
    elementwise = -coefficient * target_logprobs * _float(inputs["advantages"], target_logprobs)
    return elementwise.sum(), elementwise


def dro(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """DRO (Richemond et al. 2024): the log-likelihood times the advantage with a quadratic
    penalty on the log-ratio: L = −Σ [lp·A − ½·β·(lp − q)²].

    ``config["beta"]`` is required (Tinker publishes no default). At lp = q the penalty and its
    gradient vanish: L = −Σ lp·A, ∇L = −A·∇lp.

    Worked example: β = 0.1, lp = [−1, −0.5], q = [−1, −1.5], A = [2, −1] →
    lp − q = [0, 1]; lp·A = [−2, 0.5]; ½·β·(lp − q)² = [0, 0.05]; objective = [−2, 0.45];
    elementwise = [2, −0.45]; loss = 1.55.
    """
    if "beta" not in config:
        raise TinkerLossInputError("dro needs loss_fn_config['beta'] (a float): Tinker publishes no default")
    beta = config["beta"]
    sampling = _float(inputs["logprobs"], target_logprobs)
    objective = (
        target_logprobs * _float(inputs["advantages"], target_logprobs)
        - 0.5 * beta * (target_logprobs - sampling).square()
    )
    elementwise = -objective
    return elementwise.sum(), elementwise


def _float(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(device=like.device, dtype=like.dtype)


# -- the registry and the checks ------------------------------------------------------------------


@dataclass(frozen=True)
class TinkerLoss:
    """One supported loss: its function and what it takes.

    ``required`` / ``optional``: the ``loss_fn_inputs`` keys it needs and may take;
    ``config_keys``: the ``loss_fn_config`` keys it takes, with their defaults (``None`` =
    required); ``topk``: whether [N, K] inputs are allowed (cross_entropy's distillation form).
    """

    name: str
    fn: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config_keys: Mapping[str, float | None] | None = None
    topk: bool = False

    def __call__(
        self, target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(target_logprobs, inputs, config)

    def resolve_config(self, config: Mapping[str, float | str] | None) -> dict[str, float]:
        """``config`` checked against this loss, with the defaults filled in.

        Raises :class:`TinkerLossInputError` naming an unknown key (and the accepted ones), a
        non-number value, a missing required key, or clip bounds that are not
        0 <= low <= high.
        """
        accepted = dict(self.config_keys or {})
        given = dict(config or {})
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            expected = ", ".join(sorted(accepted)) if accepted else "no keys"
            raise TinkerLossInputError(
                f"loss_fn_config for {self.name} has unknown key(s) {unknown}; it takes {expected}"
            )
        resolved: dict[str, float] = {}
        for key, default in accepted.items():
            if key in given:
                value = given[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise TinkerLossInputError(
                        f"loss_fn_config[{key!r}] for {self.name} must be a finite number, got {value!r}"
                    )
                resolved[key] = float(value)
            elif default is None:
                raise TinkerLossInputError(
                    f"{self.name} needs loss_fn_config[{key!r}] (a number): Tinker publishes no default"
                )
            else:
                resolved[key] = default
        low, high = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
        if low is not None and high is not None and not 0.0 <= low <= high:
            raise TinkerLossInputError(
                f"{self.name}'s clip thresholds are ratio bounds and need 0 <= clip_low_threshold <= "
                f"clip_high_threshold, got {low} and {high} (e.g. 0.8 and 1.2 for PPO's ε = 0.2)"
            )
        return resolved

    def check_inputs(
        self,
        inputs: Mapping[str, torch.Tensor],
        num_positions: int,
        *,
        vocab_size: int | None = None,
        datum: int = 0,
    ) -> None:
        """Check one datum's ``loss_fn_inputs`` against this loss.

        ``num_positions`` is N, the datum's ``model_input`` length. Every input must be [N]
        (or, for a ``topk`` loss, ``target_tokens`` and ``weights`` both [N, K]);
        ``target_tokens`` integer ids in [0, vocab_size) when ``vocab_size`` is given, every
        other input finite floats. Raises :class:`TinkerLossInputError` naming the loss, the
        datum index, the key and what was expected.
        """
        where = f"datum {datum}: loss_fn_inputs for {self.name}"
        missing = [k for k in self.required if k not in inputs]
        extra = sorted(k for k in inputs if k not in self.required and k not in self.optional)
        if missing or extra:
            takes = ", ".join(self.required) + (
                f" (optionally {', '.join(self.optional)})" if self.optional else ""
            )
            problems = ([f"missing {missing}"] if missing else []) + (
                [f"unexpected {extra}"] if extra else []
            )
            raise TinkerLossInputError(f"{where}: {' and '.join(problems)}; it takes {takes}")
        target_shape = tuple(inputs["target_tokens"].shape)
        if target_shape[:1] != (num_positions,) or len(target_shape) > (2 if self.topk else 1):
            form = f"[{num_positions}] or [{num_positions}, K]" if self.topk else f"[{num_positions}]"
            raise TinkerLossInputError(
                f"{where}: target_tokens has shape {list(target_shape)}, expected {form} "
                f"(one target per model_input position, N = {num_positions})"
            )
        for key, tensor in inputs.items():
            if key != "target_tokens" and tuple(tensor.shape) != target_shape:
                raise TinkerLossInputError(
                    f"{where}: {key} has shape {list(tensor.shape)}, expected {list(target_shape)} "
                    "(the shape of target_tokens)"
                )
            if key == "target_tokens":
                _check_token_ids(where, tensor, vocab_size)
            else:
                _check_finite_floats(where, key, tensor)
        if "weights" in inputs and self.name != "cross_entropy":
            _check_weights_are_an_advantage_mask(where, inputs["weights"], inputs["advantages"])


def _check_token_ids(where: str, tokens: torch.Tensor, vocab_size: int | None) -> None:
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise TinkerLossInputError(
            f"{where}: target_tokens must be integer token ids (int64), got {tokens.dtype}"
        )
    if vocab_size is not None and tokens.numel():
        bad = (tokens < 0) | (tokens >= vocab_size)
        if bool(bad.any()):
            index = int(bad.flatten().nonzero()[0])
            raise TinkerLossInputError(
                f"{where}: target_tokens[{index}] = {int(tokens.flatten()[index])} is not a token id of "
                f"this model (expected 0 <= id < {vocab_size})"
            )


def _check_finite_floats(where: str, key: str, tensor: torch.Tensor) -> None:
    if not tensor.dtype.is_floating_point:
        raise TinkerLossInputError(f"{where}: {key} must be float32, got {tensor.dtype}")
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        index = int((~finite).flatten().nonzero()[0])
        raise TinkerLossInputError(
            f"{where}: {key}[{index}] = {float(tensor.flatten()[index])} is not finite (a NaN or inf "
            "would poison the accumulated gradient)"
        )


def _check_weights_are_an_advantage_mask(where: str, weights: torch.Tensor, advantages: torch.Tensor) -> None:
    # Tinker's RL losses have no weights, yet its docs' RL datum carries them. Ignoring them is
    # exactly the documented loss; it is also what the client meant only when every weight is
    # 1, or 0 on a token whose advantage is 0 (which contributes nothing either way). Anything
    # else would train differently from what was asked, silently: refused.
    ok = ((weights == 1) | ((weights == 0) & (advantages == 0))).all()
    if not bool(ok):
        raise TinkerLossInputError(
            f"{where}: weights must be 1, or 0 where advantages are 0: Tinker's policy-gradient "
            "losses take no per-token weights (mask a token with advantages = 0 instead)"
        )


_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

TINKER_LOSSES: Mapping[str, TinkerLoss] = {
    loss.name: loss
    for loss in (
        TinkerLoss("cross_entropy", cross_entropy, ("target_tokens", "weights"), topk=True),
        TinkerLoss("importance_sampling", importance_sampling, _RL_INPUTS, ("weights",)),
        TinkerLoss(
            "ppo",
            ppo,
            _RL_INPUTS,
            ("weights",),
            dict(zip(_CLIP_KEYS, (PPO_CLIP_LOW, PPO_CLIP_HIGH), strict=True)),
        ),
        TinkerLoss(
            "cispo",
            cispo,
            _RL_INPUTS,
            ("weights",),
            dict(zip(_CLIP_KEYS, (CISPO_CLIP_LOW, CISPO_CLIP_HIGH), strict=True)),
        ),
        # No weights for DRO: its penalty does not vanish where A = 0, so they cannot be ignored.
        TinkerLoss("dro", dro, _RL_INPUTS, (), {"beta": None}),
    )
}


def tinker_loss(name: str) -> TinkerLoss:
    """The supported loss called ``name``; :class:`ValueError` naming the supported losses (and,
    for a Tinker loss we refuse, why) for anything else."""
    if name in TINKER_LOSSES:
        return TINKER_LOSSES[name]
    supported = ", ".join(TINKER_LOSSES)
    if name in REFUSED_LOSSES:
        raise ValueError(
            f"loss_fn {name!r} is not supported by this server: {REFUSED_LOSSES[name]}. "
            f"Supported: {supported}"
        )
    raise ValueError(f"unknown loss_fn {name!r}; supported: {supported}")


def batch_loss(
    loss: TinkerLoss,
    target_logprobs: list[torch.Tensor],
    inputs: list[Mapping[str, torch.Tensor]],
    config: Mapping[str, float],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of several datums: the SUM of their losses (0 for none), and each datum's
    elementwise loss, in order. ``target_logprobs[i]`` and ``inputs[i]`` belong to datum i."""
    if len(target_logprobs) != len(inputs):
        raise ValueError(f"{len(target_logprobs)} target_logprobs for {len(inputs)} datums")
    total = torch.zeros(())
    elementwise: list[torch.Tensor] = []
    for lp, datum_inputs in zip(target_logprobs, inputs, strict=True):
        datum_loss, datum_elementwise = loss(lp, datum_inputs, config)
        total = datum_loss if not elementwise else total + datum_loss
        elementwise.append(datum_elementwise)
    return total, elementwise


def check_metric_key(key: str) -> str:
    """``key`` if it is a metric name the SDK accepts (``"name:reduction"``, exactly one colon,
    a reduction in :data:`METRIC_REDUCTIONS`, a non-empty name); ValueError otherwise."""
    name, colon, reduction = key.partition(":")
    if not colon or not name or ":" in reduction or reduction not in METRIC_REDUCTIONS:
        raise ValueError(
            f"metric key {key!r} must be 'name:reduction' with one colon and a reduction in "
            f"{METRIC_REDUCTIONS}"
        )
    return key
