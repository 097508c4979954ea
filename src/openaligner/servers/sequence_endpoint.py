"""What the two inference endpoints (``reward_model``, ``critic_infer``) share: their settings, the
check of one request, and the shaping of a formed batch before the forward pass.

Owns :class:`SequenceEndpoint`: a request is ``sentences``, ``messages`` or ``tokens`` +
``sequence_lengths``; a formed batch is merged, stripped and padded to whole micro-batches on
every rank. Shapes: ``tokens`` [B, S] int64 right-padded, ``lengths`` [B] int64.
Must not know about PyTriton, HTTP, models or torch.distributed.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from openaligner.protocol import tokenizer_description
from openaligner.servers.batching import EndpointStats, merge_rows, pad_rows, padding_multiple, strip_columns
from openaligner.servers.validation import RenderFn, SequenceRequest, TokenizeFn, parse_sequence_request


class SequenceEndpoint:
    """The base of an endpoint that scores whole sequences.

    Args:
        model_name: the Triton model name it is served under.
        tokenize_func: turns ``sentences`` into tokens; None refuses sentences.
        render_func: lays ``messages`` out as the model was trained; None refuses messages.
        tokenizer_info: what the server says of its tokenizer on the tokenizer route
            (:func:`~openaligner.protocol.tokenizer_description`); None: it has none.
        vocab_size: token ids must lie in ``[0, vocab_size)``; None skips the check.
        max_sequence_length: longest accepted sequence; None skips the check.
        max_batch_size: most rows per request.
        forward_micro_batch_size: rows per forward pass on one rank.
        strip_sequence_length_to_multiple: compute at a width that is a multiple of this; None: the
            longest row (see :func:`~openaligner.servers.batching.strip_columns`).
        dp_size: number of ranks sharing the batch.
        batch_invariant: the forward computes rows in fixed shapes
            (:class:`~openaligner.models.fixed_shapes.FixedShapes`), so rows are padded only to a
            multiple of ``dp_size``, not to whole micro-batches.
    """

    def __init__(
        self,
        *,
        model_name: str,
        tokenize_func: TokenizeFn | None = None,
        render_func: RenderFn | None = None,
        tokenizer_info: Mapping[str, object] | None = None,
        vocab_size: int | None = None,
        max_sequence_length: int | None = None,
        max_batch_size: int = 1024,
        forward_micro_batch_size: int = 4,
        strip_sequence_length_to_multiple: int | None = None,
        dp_size: int = 1,
        batch_invariant: bool = False,
    ) -> None:
        self.model_name = model_name
        self.tokenize_func = tokenize_func
        self.render_func = render_func
        self.tokenizer_info = dict(tokenizer_info or tokenizer_description(None, None, None))
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.forward_micro_batch_size = forward_micro_batch_size
        self.strip_multiple = strip_sequence_length_to_multiple
        self.dp_size = dp_size
        self.batch_invariant = batch_invariant
        self.stats = EndpointStats()
        self._stats_lock = threading.Lock()

    def validate(self, inputs: Mapping[str, np.ndarray]) -> SequenceRequest:
        """Check one request and convert it to tensors (see :func:`parse_sequence_request`)."""
        return parse_sequence_request(
            inputs,
            tokenize_func=self.tokenize_func,
            render_func=self.render_func,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            max_batch_size=self.max_batch_size,
        )

    def shaped_batch(self, requests: Sequence[SequenceRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """The formed batch as the forward takes it: the requests' rows merged, trailing columns
        stripped, rows padded to whole micro-batches on every rank (with ``batch_invariant``: to a
        multiple of the ranks; padded rows come last, after the requests' rows in order). Counts
        the call in :attr:`stats`.

        Returns:
            ``tokens`` [B', S'] and ``lengths`` [B'], B' >= the requests' rows, S' <= their width.
        """
        tokens, lengths = merge_rows([(r.tokens, r.lengths) for r in requests])
        tokens = strip_columns(tokens, lengths, self.strip_multiple)
        rows = tokens.shape[0]
        # fixed shapes make their own micro-batches; filler rows here would be computed as rows
        multiple = (
            self.dp_size
            if self.batch_invariant
            else padding_multiple(rows, self.forward_micro_batch_size, self.dp_size)
        )
        tokens, lengths, extra = pad_rows(tokens, lengths, multiple)
        with self._stats_lock:
            self.stats.calls += 1
            self.stats.requests += len(requests)
            self.stats.rows += rows
            self.stats.padded_rows += extra
        return tokens, lengths
