"""The critic-stall rule: whether a run's critic learned nothing in its first critic updates.

Owns the rule (one held-out explained variance per step in, at most one verdict out), the verdict's
message and its error type. Must not know the trainer, the servers or logging: ``PPOTrainer``
feeds it ``value/explained_variance_mc`` and warns or raises (``trainer.critic_stall``, docs/ppo.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CRITIC_STALL_MODES = ("warn", "error", "ignore")
"""``trainer.critic_stall.mode``: a warning once, a :class:`CriticStallError` that ends the run, or none."""


class CriticStallError(RuntimeError):
    """The critic's held-out explained variance did not rise (``trainer.critic_stall.mode=error``)."""


UPDATE_GAIN_MOVES = 0.02
"""An update's own gain in explained variance on the rows it trained on (the server's
``explained_variance_after`` − ``train_explained_variance``) this small did not move the critic,
and one at or below −this made it worse where it was aimed: an overshoot. Measured on the demo over
the first 15 updates (docs/ppo.md, *A critic that does not learn*): at 1/100 of its critic
learning rate every gain within ±0.01; at 10× and 100× a worst gain of −0.03 to −1.4; at its own
rate and at 1/10 none below +0.006."""

MIN_UPDATE_GAIN = 0.04
"""The updates' mean own-row gain at which, with no overshoot, the learning rate evidently moves
the critic: no verdict then (``trainer.critic_stall.min_update_gain``). Measured on the demo
(docs/ppo.md, *A critic that does not learn*): at 1/10 and 1/100 of its critic learning rate a
mean of +0.003 to +0.029 (warned rightly), at its own rate +0.059 to +0.072 — the full mode's
seed 1 among them, whose held-out explained variance went 0.40 → at best 0.45 while its gold rose
46.8 → 91.3: the held-out figure then says how predictable those rollouts' returns are, not that
the rate is wrong."""


@dataclass(frozen=True)
class CriticStall:
    """The verdict: after ``updates`` critic updates the held-out explained variance went from
    ``first`` (before the first update this run) to at best ``best``, and is ``last`` now;
    ``update_gain`` and ``worst_update_gain`` are the updates' mean and lowest gain on their own
    rows (NaN: the server did not say)."""

    updates: int
    first: float
    best: float
    last: float
    update_gain: float
    worst_update_gain: float
    min_rise: float
    min_explained_variance: float

    @property
    def cause(self) -> str:
        """The likely cause and its fix: a learning rate too large when an update made the critic
        worse on its own rows (:data:`UPDATE_GAIN_MOVES`), else too small."""
        gain, worst = self.update_gain, self.worst_update_gain
        if math.isnan(gain):
            return (
                "the critic's learning rate is likely too small (updates that do not move it) or too "
                "large (updates that overshoot): try serve-critic's optim.lr 10× either way"
            )
        if worst <= -UPDATE_GAIN_MOVES:
            return (
                f"an update made it worse even on the rows it trained on (gain {worst:+.3f}): the "
                "critic's learning rate is likely too large — lower serve-critic's optim.lr (e.g. 10×)"
            )
        hardly = "hardly moved it" if gain < UPDATE_GAIN_MOVES else "moved it only a little"
        return (
            f"its updates {hardly} even on the rows they trained on (mean gain {gain:+.3f}): the "
            "critic's learning rate is likely too small — raise serve-critic's optim.lr (e.g. 10×)"
        )

    def message(self) -> str:
        """What was measured, the likely cause and the fix, and the settings that change the check."""
        return (
            f"the critic is not learning: after {self.updates} critic updates its held-out explained "
            f"variance (value/explained_variance_mc) went {self.first:.3f} → {self.last:.3f}, at best "
            f"{self.best:.3f}, neither rising by trainer.critic_stall.min_rise={self.min_rise:g} nor "
            f"reaching trainer.critic_stall.min_explained_variance={self.min_explained_variance:g}. "
            f"PPO's advantages then carry the critic's errors and the policy learns less. Likely cause: "
            f"{self.cause}; or pretrain the critic (trainer.value_pretrain). Set "
            "trainer.critic_stall.mode=ignore to silence this check, =error to stop the run instead"
        )


class CriticStallCheck:
    """Judges once, after ``updates`` critic updates: the critic stalled when its held-out
    explained variance neither rose by ``min_rise`` above its first value nor reached
    ``min_explained_variance`` at any of the steps after an update, unless its updates evidently
    moved it on their own rows without overshooting (``min_update_gain``).

    Feed :meth:`observe` every step's held-out explained variance in order, measured before that
    step's critic update (so the i-th value, from 0, follows i updates of this run), and
    :meth:`update` each update's explained variance on its own rows as the server reports it —
    during the pass (``value/train_explained_variance``: of each micro-batch's values before its
    own step, averaged; with one step per update, before the update) and after it — for the
    verdict's cause only. A NaN (returns of zero variance) counts as an update but is no
    evidence; with no finite value, no verdict.

    Args:
        updates: critic updates before the verdict (≥ 1).
        min_rise: the rise above the first value that counts as learning (≥ 0).
        min_explained_variance: a value that counts as a critic good enough not to need to rise.
        min_update_gain: updates whose mean gain on their own rows reaches this, none of them an
            overshoot (a gain ≤ −:data:`UPDATE_GAIN_MOVES`), move the critic as they should: no
            verdict (:data:`MIN_UPDATE_GAIN`; a server that reports no gain is judged on the held-out
            figure alone).
    """

    def __init__(
        self,
        updates: int,
        min_rise: float,
        min_explained_variance: float,
        min_update_gain: float = MIN_UPDATE_GAIN,
    ) -> None:
        if updates < 1:
            raise ValueError(f"updates must be ≥ 1, got {updates}")
        self.updates = updates
        self.min_rise = min_rise
        self.min_explained_variance = min_explained_variance
        self.min_update_gain = min_update_gain
        self._seen = 0
        self._first = math.nan
        self._best = -math.inf
        self._last = math.nan
        self._gains: list[float] = []
        self._judged = False

    def update(self, before: float, after: float) -> None:
        """Record one critic update's explained variance of its own rows during and after it (the
        server's; NaN when it does not report them; see the class docstring)."""
        gain = float(after) - float(before)
        if not math.isnan(gain) and not self._judged:
            self._gains.append(gain)

    def observe(self, explained_variance: float) -> CriticStall | None:
        """Record one step's held-out explained variance; returns the verdict at the step after the
        ``updates``-th update if the critic stalled, else None (and None ever after the verdict)."""
        if self._judged:
            return None
        ev, after_updates = float(explained_variance), self._seen
        self._seen += 1
        if not math.isnan(ev):
            if math.isnan(self._first):
                self._first = ev
            elif after_updates > 0:
                self._best = max(self._best, ev)
            self._last = ev
        if after_updates < self.updates:
            return None
        self._judged = True
        if math.isnan(self._first) or self._best == -math.inf:
            return None
        if self._best >= self._first + self.min_rise or self._best >= self.min_explained_variance:
            return None
        gain = sum(self._gains) / len(self._gains) if self._gains else math.nan
        worst = min(self._gains) if self._gains else math.nan
        if gain >= self.min_update_gain and worst > -UPDATE_GAIN_MOVES:  # NaN compares False
            return None  # the rate moves the critic without overshooting: not the rate's fault
        return CriticStall(
            after_updates,
            self._first,
            self._best,
            self._last,
            gain,
            worst,
            self.min_rise,
            self.min_explained_variance,
        )
