"""The ``hf`` rollout engine: the project's own sampling loop over the actor's modules.

Owns only the mapping of a :class:`~openaligner.rollout.engine.RolloutRequest` onto
:meth:`CausalLMActor.infer <openaligner.models.actor.CausalLMActor.infer>` and of its output onto
the ``Generation`` layout; the loop, its decoders and fast paths are ``models/``'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from openaligner.rollout.engine import RolloutEngine, RolloutRequest

if TYPE_CHECKING:
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import Generation


class HFRolloutEngine(RolloutEngine):
    """The project's own sampling loop (:func:`~openaligner.models.generation.generate`) over the
    actor's modules: generation is :meth:`CausalLMActor.infer <openaligner.models.actor.CausalLMActor.infer>`
    (sharded policies gathered or stepped layer by layer, the precision's autocast, the fast
    decoders), so new weights are seen at once and :meth:`update_weights` does nothing.

    Seeds: by default a request is sampled as one batch from one ``torch.Generator`` on the
    actor's device seeded with ``seeds[0]``; the rows share that random stream, so a row's tokens
    depend on its batch-mates (as they always have: this keeps rollouts bit-identical to the loop
    before the seam). The other seeds are not read. With ``per_row_streams``, row ``i`` draws from
    its own stream seeded ``seeds[i]`` (:func:`~openaligner.models.generation.row_draws`), so its
    tokens do not depend on its batch-mates beyond float rounding of the batched forward.
    """

    name = "hf"
    shares_weights = True

    def __init__(self, actor: CausalLMActor, *, per_row_streams: bool = False) -> None:
        self.actor = actor
        self.per_row_streams = per_row_streams

    def generate(self, request: RolloutRequest) -> Generation:
        from openaligner.models.generation import Generation, row_draws

        device = self.actor.device
        batch = {"text": request.prompts.to(device), "length": request.prompt_lengths.to(device)}
        if self.per_row_streams:
            draws = row_draws(request.seeds.tolist(), request.sampling.max_new_tokens)
            out = self.actor.infer(batch, request.sampling, draws=draws)
        else:
            generator = torch.Generator(device=device).manual_seed(int(request.seeds[0]))
            out = self.actor.infer(batch, request.sampling, generator=generator)
        return Generation(
            tokens=out["response_tokens"].cpu(),
            sequence_lengths=out["response_lengths"].cpu(),
            prompt_lengths=out["prompt_lengths"].cpu(),
            is_end=out["is_end"].cpu(),
        )
