"""The reward model server: a frozen reward function behind Triton's ``reward_model`` endpoint.

Owns the endpoint's logic (:class:`RewardEndpoint`), its deployment (:class:`RewardModelServer`:
rank 0 runs Triton and leads) and its settings (:class:`RewardServerConfig`). Inputs:
``sentences`` or ``tokens`` with ``sequence_lengths``; output ``rewards`` [B, 1]. Must not know how
rewards are computed, nor about HTTP details.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from openaligner import distributed as dp
from openaligner.data.render import (
    LayoutError,
    Renderer,
    SequenceLayout,
    cut_rendered,
    generation_prompt,
    response_part,
    with_bos,
    with_eos,
)
from openaligner.models.fixed_shapes import FixedShapes
from openaligner.protocol import (
    REWARD_DEFAULT_PORT,
    REWARD_INPUTS,
    REWARD_MODEL_NAME,
    REWARD_OUTPUTS,
)
from openaligner.servers.batching import split_rows
from openaligner.servers.config import ServingConfig
from openaligner.servers.distributed import Opcode, Rank0Dispatcher
from openaligner.servers.reward_formats import TextReading, reward_routes
from openaligner.servers.reward_function import RewardFunctionEndpoint, ScoreTexts
from openaligner.servers.sequence_endpoint import SequenceEndpoint
from openaligner.servers.transport.lifecycle import ServerLifecycle
from openaligner.servers.validation import RenderFn, RequestError, SequenceRequest, TokenizeFn

LOGGER = logging.getLogger(__name__)

InferFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(tokens [b, S] int64, lengths [b] int64) -> rewards [b]``; called once per micro-batch."""


class RewardEndpoint(SequenceEndpoint):
    """The ``reward_model`` endpoint as a plain object (see :class:`~.transport.triton.Endpoint`).

    Args:
        forward: ``(tokens [B, S], lengths [B]) -> rewards [B]`` for a whole shaped batch, where
            ``B`` is a multiple of ``dp_size`` (usually the dispatcher's FORWARD).
        model_name, settings: see :class:`~openaligner.servers.sequence_endpoint.SequenceEndpoint`.
    """

    inputs = REWARD_INPUTS
    outputs = REWARD_OUTPUTS

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        model_name: str = REWARD_MODEL_NAME,
        **settings: Any,
    ) -> None:
        super().__init__(model_name=model_name, **settings)
        self.forward = forward

    def run(self, requests: Sequence[SequenceRequest]) -> list[dict[str, np.ndarray]]:
        """Answer a formed batch: shape it, forward, drop padding, split per request."""
        tokens, lengths = self.shaped_batch(requests)
        rewards = self.forward(tokens, lengths).detach().to("cpu", torch.float32).reshape(-1)
        pieces = split_rows(rewards, [r.rows for r in requests])
        return [{"rewards": p.reshape(-1, 1).numpy()} for p in pieces]


def micro_batched(
    infer_fn: InferFn, micro_batch_size: int, shapes: FixedShapes | None = None, forwards: int = 0
) -> InferFn:
    """``infer_fn`` applied to consecutive slices of ``micro_batch_size`` rows, results concatenated;
    with ``shapes``, to every row in its fixed shape instead, running at least ``forwards`` forwards
    (see :class:`~openaligner.models.fixed_shapes.FixedShapes`)."""

    def run(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if shapes is not None:
            return shapes.run(lambda t, n: infer_fn(t, n).reshape(-1).float(), tokens, lengths, forwards)
        parts = [
            infer_fn(tokens[i : i + micro_batch_size], lengths[i : i + micro_batch_size]).reshape(-1).float()
            for i in range(0, tokens.shape[0], micro_batch_size)
        ]
        return torch.cat(parts) if parts else torch.zeros(0)

    return run


PROMPT_STRINGS = ("auto", "rendered", "raw")
"""How a prompt string sent in another framework's format is read (``server.prompt_strings``):
``rendered`` — already laid out with a chat template (the whole text is read as it stands);
``raw`` — the user's message (laid out with the model's template, if it has one); ``auto`` —
``rendered`` for a model trained with a chat template, else ``raw``."""


@dataclass(kw_only=True)
class RewardServerConfig(ServingConfig):
    """How the reward model server serves: the ``server`` section of ``openaligner serve-reward``
    (the keys both servers share are :class:`~openaligner.servers.config.ServingConfig`'s)."""

    port: int = REWARD_DEFAULT_PORT  # HTTP port
    model_name: str = REWARD_MODEL_NAME  # Triton model name that clients ask for
    remote_rm_reward_key: str | None = None  # POST /remote_rm (slime) answers {key: reward}; null: the number
    prompt_strings: str = "auto"  # other formats' prompt strings: rendered | raw | auto (the model's layout)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt_strings not in PROMPT_STRINGS:
            raise ValueError(
                f"{{section}}.prompt_strings must be one of {', '.join(PROMPT_STRINGS)}, got "
                f"{self.prompt_strings!r}"
            )

    def prompts_rendered(self, chat_template: bool) -> bool:
        """Whether a prompt string of another framework's format is taken as already rendered, for
        a model trained with (``chat_template``) or without a chat template."""
        return chat_template if self.prompt_strings == "auto" else self.prompt_strings == "rendered"


class RewardModelServer(ServerLifecycle):
    """Serve ``infer_fn`` as Triton model ``cfg.model_name`` on ``cfg.host:cfg.port``.

    Create it after ``torch.distributed`` is initialised (if it is used at all): with several
    processes, rank 0 runs Triton and every rank computes an equal share of each formed batch
    (the batch is padded to a multiple of the ranks), so every rank calls ``infer_fn`` the same
    number of times: the model may be a replica or sharded
    (:func:`~openaligner.models.sharding.shard`, where each forward is a collective).

    Args:
        infer_fn: ``(tokens [b, S] int64, lengths [b] int64) -> rewards [b]`` (no grad), called
            once per ``cfg.model_forward_micro_batch_size`` rows; None: no model (a reward function
            alone).
        tokenize_func: tokenizer for ``sentences``; None refuses sentences.
        render_func: lays out ``messages`` (:func:`make_render_func`); None refuses messages.
        tokenizer_info: what the tokenizer route says (see
            :func:`~openaligner.protocol.tokenizer_description`); None: no tokenizer.
        cfg: serving settings (default :class:`RewardServerConfig`). Here ``max_sequence_length``
            None skips the length check: the server does not know the model's positions.
        vocab_size: refuse token ids outside ``[0, vocab_size)``; None skips the check.
        reward_function: scores ``(prompts, responses, metadata)`` (usually a
            :class:`~openaligner.servers.reward_function.FunctionRunner`); the server then reads
            ``messages`` (+ ``metadata``) and answers ``model_weight · model + function_weight ·
            function`` (see :class:`~openaligner.servers.reward_function.RewardFunctionEndpoint`).
        function_name: the function's name in error messages.
        chat_template: the model was trained with a chat template (its recorded layout says so);
            with ``server.prompt_strings=auto``, a prompt string sent in another framework's format
            is then taken as already rendered (see :mod:`openaligner.servers.reward_formats`).
        **settings: :class:`RewardServerConfig` keys that replace ``cfg``'s, as the keyword
            arguments of NeMo-Aligner's ``RewardModelServer``:
            ``RewardModelServer(infer_fn=f, port=5555, inference_micro_batch_size=[4, 8])``.

    Raises:
        ValueError: a setting is invalid, or the preferred batch sizes on this many ranks exceed
            ``max_batch_size``.
    """

    _describe = "the reward model server"

    def __init__(
        self,
        infer_fn: InferFn | None,
        tokenize_func: TokenizeFn | None = None,
        cfg: RewardServerConfig | None = None,
        *,
        render_func: RenderFn | None = None,
        tokenizer_info: Mapping[str, object] | None = None,
        vocab_size: int | None = None,
        reward_function: ScoreTexts | None = None,
        function_name: str = "the reward function",
        model_weight: float = 1.0,
        function_weight: float = 1.0,
        chat_template: bool = False,
        **settings: Any,
    ) -> None:
        self.cfg = replace(cfg or RewardServerConfig(), **settings)
        self.cfg.check_batching(dp.world_size(), key="server")
        if infer_fn is None and reward_function is None:
            raise ValueError("a reward server needs a reward model (infer_fn), a reward function, or both")
        self._infer_fn = infer_fn
        self._shapes = self.cfg.fixed_shapes()
        """Each row's forward in a fixed shape (``server.batch_invariant``), or None."""
        mbs = self.cfg.model_forward_micro_batch_size
        self._local_infer = micro_batched(infer_fn, mbs, self._shapes) if infer_fn else None
        self._init_lifecycle()
        sequences = RewardEndpoint(
            self._forward_from_rank0,
            model_name=self.cfg.model_name,
            tokenize_func=tokenize_func,
            render_func=render_func,
            tokenizer_info=tokenizer_info,
            vocab_size=vocab_size,
            max_sequence_length=self.cfg.max_sequence_length,
            max_batch_size=self.cfg.max_batch_size,
            forward_micro_batch_size=self.cfg.model_forward_micro_batch_size,
            strip_sequence_length_to_multiple=self.cfg.strip_sequence_length_to_multiple,
            dp_size=dp.world_size(),
            batch_invariant=self._shapes is not None,
        )
        self.endpoint: RewardEndpoint | RewardFunctionEndpoint = sequences
        if reward_function is not None:
            # Text scored by the function, and by the model too when there is one (the rows laid
            # out and shaped as the model endpoint would).
            self.endpoint = RewardFunctionEndpoint(
                reward_function,
                name=function_name,
                model_forward=self._forward_from_rank0 if infer_fn is not None else None,
                render_func=render_func,
                tokenize_func=tokenize_func,
                prepare_model_batch=sequences.shaped_batch,
                model_weight=model_weight,
                function_weight=function_weight,
                model_name=self.cfg.model_name,
                tokenizer_info=tokenizer_info,
                max_batch_size=self.cfg.max_batch_size,
                max_sequence_length=self.cfg.max_sequence_length,
            )

        self.routes = reward_routes(
            self.cfg.model_name,
            TextReading(
                function=reward_function is not None,
                model=infer_fn is not None,
                rendered_prompts=self.cfg.prompts_rendered(chat_template),
            ),
            self.cfg.remote_rm_reward_key,
        )
        """The field's other wire formats, answered beside KServe v2 (OpenRLHF, slime, classify)."""

    @property
    def url(self) -> str:
        """``http://host:port`` of the HTTP endpoint (with ``port=0``, the port picked at start once
        started)."""
        return self._host.url if self._host is not None else f"http://{self.cfg.host}:{self.cfg.port}"

    def handlers(self) -> dict[int, Callable[[Any], Any]]:
        """The opcode table every rank runs (the critic server adds TRAIN and SAVE)."""
        return {Opcode.FORWARD: self._forward_all_ranks}

    def start(self) -> bool:
        """Rank 0: start Triton and return True once it answers, or False when a stop request came
        first or interrupted the start (see :meth:`request_stop`). Other ranks: nothing (see
        run_server)."""
        if not dp.is_leader() or self._host is not None or self._stop_requested.is_set():
            return self._host is not None
        if self._dispatcher is None:
            self._dispatcher = Rank0Dispatcher(self.handlers(), heartbeat_s=self.cfg.heartbeat_s)
        host = self.cfg.triton_host()
        host.bind(self.endpoint, self.cfg.batching(dp.world_size()), threading.Lock(), routes=self.routes)
        try:
            return self._start_host(host)
        except BaseException:
            self._dispatcher.stop()
            raise

    def __enter__(self) -> RewardModelServer:
        self.start()
        return self

    def _forward_from_rank0(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self._dispatcher is None:  # endpoint used without start(): compute in this process
            assert self._local_infer is not None
            return self._local_infer(tokens, lengths)
        return self._dispatcher.call(Opcode.FORWARD, (tokens, lengths))

    def _forward_all_ranks(self, batch: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """FORWARD on every rank: receive the batch, compute this rank's rows, gather all rows."""
        tokens = dp.broadcast_tensor(batch[0] if batch is not None else None)
        lengths = dp.broadcast_tensor(batch[1] if batch is not None else None)
        local_tokens, local_lengths = dp.local_rows(tokens), dp.local_rows(lengths)
        device = dp.collective_device()
        infer_fn, shapes = self._infer_fn, self._shapes
        assert infer_fn is not None, "FORWARD is sent only when a reward model is served"
        # every rank runs as many forwards (a sharded model's forwards are collectives)
        forwards = shapes.forwards(lengths, dp.world_size()) if shapes is not None else 0
        infer = micro_batched(infer_fn, self.cfg.model_forward_micro_batch_size, shapes, forwards)
        local = dp.run_guarded(lambda: infer(local_tokens, local_lengths).to(device))
        return dp.all_gather_rows(local, same_shape=True)


MAX_CHARS_PER_TOKEN = 32
"""How many characters of a text are tokenized per token kept: a text is cut to
``max_length * MAX_CHARS_PER_TOKEN`` characters before tokenizing. Whatever lies beyond could only
reach the first ``max_length`` tokens if they averaged more than this many characters (English
text averages about 4 per BPE token), and tokenizing it would cost time for tokens the server
throws away (a 2 MB text held the server for seconds)."""


def make_tokenize_func(
    tokenizer: Any,
    max_length: int | None = None,
    max_chars_per_token: int = MAX_CHARS_PER_TOKEN,
    layout: SequenceLayout | None = None,
) -> TokenizeFn:
    """A :data:`TokenizeFn` from a Hugging Face tokenizer that lays each text out as train-rm laid
    out its sequences (:class:`~openaligner.data.render.SequenceLayout`, by default train-rm's
    default: ``[BOS] + ids(text) + [EOS]``, each added when the tokenizer has it and the text's ids
    do not already start / end with it), right-padded with the tokenizer's pad id (0 when it has
    none). A text without ids of its own gets length 0, whatever the layout adds, so that it is
    refused.

    ``layout`` is the one recorded next to the reward model (``SequenceLayout.load(model_dir)``).
    With ``layout.chat_template`` a text is a conversation already rendered with the reward model's
    chat template (verl's ``/classify`` ``input``; the server renders nothing), and it gets the ids
    train-rm gave that conversation: it is cut after its last generation prompt
    (:func:`~openaligner.data.render.cut_rendered`) into the prompt part, ``[BOS] + ids(prompt)``,
    and the response part without the whitespace the template writes after the turn,
    ``ids(response) + [EOS]`` — tokenized apart, as in training, and never a second EOS. A text
    with no generation prompt in it is the whole sequence between BOS and EOS, less its trailing
    whitespace.

    With ``max_length``: a whole text's own ids are cut to fit, BOS and EOS kept; a cut
    conversation keeps its first ``max_length - 1`` ids and its last (the EOS the reward is read
    at), as a ``messages`` row does. Each text is first cut to ``max_length * max_chars_per_token``
    characters, so that a request costs what the server keeps, however long its texts. Calls are
    serialised (the HTTP front's workers and the served callable both validate): a fast tokenizer
    fails with "Already borrowed" when another thread is encoding with it
    (huggingface/tokenizers#537).
    """
    layout = layout if layout is not None else SequenceLayout()
    bos_id, eos_id = layout.special_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_chars = max_length * max_chars_per_token if max_length is not None else None
    max_text = (
        None if max_length is None else max(1, max_length - (bos_id is not None) - (eos_id is not None))
    )
    # where a rendered conversation's prompt part ends; None for raw text (nothing to cut)
    cut_at = generation_prompt(tokenizer) if layout.chat_template else None
    lock = threading.Lock()

    def parts(text: str) -> tuple[str, ...]:
        """The text as train-rm's parts: (prompt, response), or the whole text alone."""
        if not layout.chat_template:
            return (text,)
        cut = cut_rendered(text, cut_at)
        return cut if cut is not None else (response_part(text),)

    def laid_out(ids: list[list[int]]) -> list[int]:
        if len(ids) == 2:  # a rendered conversation: the prompt part, then the response part
            row = with_bos(ids[0], bos_id) + with_eos(ids[1], eos_id)
            return row if max_length is None or len(row) <= max_length else row[: max_length - 1] + row[-1:]
        body = ids[0][:max_text] if max_text is not None else ids[0]
        return with_eos(with_bos(body, bos_id), eos_id) if body else []

    def tokenize(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if max_chars is not None:
            texts = [t[:max_chars] for t in texts]
        pieces = [parts(t) for t in texts]
        with lock:  # one call for every piece of every text: the fast tokenizer batches them
            flat = tokenizer(
                [p for ps in pieces for p in ps], add_special_tokens=False, truncation=False, max_length=None
            )["input_ids"]
        rows, at = [], 0
        for ps in pieces:
            rows.append(laid_out([list(x) for x in flat[at : at + len(ps)]]))
            at += len(ps)
        width = max(1, max(len(x) for x in rows))
        tokens = torch.full((len(rows), width), pad_id, dtype=torch.int64)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        return tokens, torch.tensor([len(x) for x in rows], dtype=torch.int64)

    return tokenize


def make_render_func(tokenizer: Any, layout: SequenceLayout | None = None) -> RenderFn:
    """A :data:`~openaligner.servers.validation.RenderFn` that lays each conversation out exactly as
    train-rm laid out a preference example (:meth:`~openaligner.data.render.Renderer.example_ids`
    of the conversation before the last message and that last, assistant, message): rendered with
    the reward model's chat template when ``layout.chat_template``, else raw text, where the prompt
    must be a single user message (as a text prompt is). A sequence longer than ``max_length`` keeps
    its first ``max_length - 1`` ids and its last one (the EOS the reward is read at). Rows are
    right-padded with the tokenizer's pad id (0 when it has none). Calls are serialised (see
    :func:`make_tokenize_func`).

    Args:
        tokenizer: the reward model's tokenizer.
        layout: the layout recorded next to the reward model (train-rm's default when None).
    """
    renderer = Renderer(tokenizer, layout if layout is not None else SequenceLayout())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lock = threading.Lock()

    def render(
        conversations: list[list[dict[str, str]]], max_length: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for row, conversation in enumerate(conversations):
            prompt_messages, response = conversation[:-1], conversation[-1]
            prompt: str | tuple[dict[str, str], ...] = tuple(prompt_messages)
            if not renderer.layout.chat_template:
                if len(prompt_messages) != 1 or prompt_messages[0]["role"] != "user":
                    raise RequestError(
                        f"input 'messages': row {row} has {len(prompt_messages)} message(s) before the "
                        "response, but this reward model was trained on raw text (no chat template): send "
                        "one user message and the assistant's response, or 'sentences'"
                    )
                prompt = prompt_messages[0]["content"]
            try:
                with lock:
                    prompt_ids, response_ids = renderer.example_ids(prompt, response)
            except LayoutError as e:
                raise RequestError(f"input 'messages': row {row} cannot be laid out: {e}") from None
            ids = prompt_ids + response_ids
            if max_length is not None and len(ids) > max_length:
                ids = ids[: max_length - 1] + ids[-1:]
            rows.append(ids)
        width = max(1, max((len(r) for r in rows), default=1))
        tokens = torch.full((len(rows), width), pad_id, dtype=torch.int64)
        for i, ids in enumerate(rows):
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return tokens, torch.tensor([len(r) for r in rows], dtype=torch.int64)

    return render
