"""The serving settings both servers share, checked once: address, Triton's batcher, the endpoint's
limits and micro-batches, the rank-0 heartbeat and the server's files.

Owns :class:`ServingConfig`, the base of :class:`~openaligner.servers.reward.RewardServerConfig`
and :class:`~openaligner.servers.critic.CriticServerConfig` (each adds its own keys and its
default port). The ``serve-*`` commands hold these dataclasses as their ``server`` section as they
are, so the load-time messages write ``{section}`` where that key belongs (see
:mod:`openaligner.config.loading`). Must not know what an endpoint computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from openaligner.models.fixed_shapes import INVARIANT_WIDTH_MULTIPLE, FixedShapes
from openaligner.protocol import DEFAULT_HOST
from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES
from openaligner.servers.transport.triton import Batching, TritonHost

TRITON_MAX_BATCH_SIZE: Final = 2**31 - 1
"""The largest batch size Triton's model config can hold (an int32 field)."""


@dataclass(kw_only=True)
class ServingConfig:
    """How a server serves; every key as the ``server`` section of its command."""

    host: str = DEFAULT_HOST  # address to bind; anything but loopback is logged as a warning
    port: int  # HTTP port (each server's config sets its default); 0: any free port, named when ready
    inference_micro_batch_size: list[int] = field(default_factory=lambda: [4])  # preferred rows per rank
    model_forward_micro_batch_size: int = 4  # rows per forward pass on one rank
    strip_sequence_length_to_multiple: int | None = None  # compute width multiple (null: longest row)
    batch_invariant: bool = False  # each row in a fixed shape: its outputs never depend on its batch-mates
    max_queue_delay_microseconds: int = 2000  # how long Triton holds a request for others to merge with
    max_batch_size: int = 1024  # most rows per request and per formed batch
    max_sequence_length: int | None = None  # longest accepted sequence; null: the model's position limit
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest HTTP request body (HTTP 413 above)
    exit_timeout_s: int = 3  # at stop, how long calls in progress may take to finish
    heartbeat_s: float | None = 60.0  # idle heartbeat to the other ranks, within the pg timeout; null: none
    log_file: str | None = None  # tritonserver's log file; null: a temporary file removed at stop
    workspace_dir: str | None = None  # root of the server's own files; null: <tmp>/openaligner-servers-<uid>

    def __post_init__(self) -> None:
        # {section}: the key this section has in the command's schema (server), see the docstring
        if isinstance(self.inference_micro_batch_size, int):  # the seed API's int form
            self.inference_micro_batch_size = [self.inference_micro_batch_size]
        if not 0 <= self.port < 65536:
            raise ValueError(f"{{section}}.port must be in 0..65535 (0: any free port), got {self.port}")
        if not self.inference_micro_batch_size or min(self.inference_micro_batch_size) < 1:
            raise ValueError(
                "{section}.inference_micro_batch_size must be a list of sizes >= 1, e.g. [4], "
                f"got {self.inference_micro_batch_size}"
            )
        if self.model_forward_micro_batch_size < 1:
            raise ValueError("{section}.model_forward_micro_batch_size must be >= 1")
        if self.strip_sequence_length_to_multiple is not None and self.strip_sequence_length_to_multiple < 1:
            raise ValueError("{section}.strip_sequence_length_to_multiple must be >= 1 or null")
        if not 1 <= self.max_batch_size <= TRITON_MAX_BATCH_SIZE:
            raise ValueError(
                f"{{section}}.max_batch_size must be in 1..{TRITON_MAX_BATCH_SIZE} (Triton's limit), "
                f"got {self.max_batch_size}"
            )
        if self.max_queue_delay_microseconds < 0:
            # PyTriton drops a negative delay from the model config without a word: Triton would
            # then not wait at all, which is not what was asked for
            raise ValueError(
                "{section}.max_queue_delay_microseconds must be >= 0 (0: no wait), got "
                f"{self.max_queue_delay_microseconds}"
            )
        if self.heartbeat_s is not None and self.heartbeat_s <= 0:
            raise ValueError("{section}.heartbeat_s must be > 0 (or null: no heartbeat)")
        if self.max_request_bytes < 1:
            raise ValueError(f"{{section}}.max_request_bytes must be >= 1, got {self.max_request_bytes}")
        self.check_batching(world_size=1)  # more ranks: the commands check again once they know

    def fixed_width_multiple(self) -> int | None:
        """The batch-invariant forwards' width multiple (``batch_invariant``), else None:
        ``strip_sequence_length_to_multiple``, :data:`INVARIANT_WIDTH_MULTIPLE` when null. The
        critic server's training forward rounds to it too."""
        if not self.batch_invariant:
            return None
        return self.strip_sequence_length_to_multiple or INVARIANT_WIDTH_MULTIPLE

    def fixed_shapes(self) -> FixedShapes | None:
        """The batch-invariant inference forward's shapes (``batch_invariant``), else None: every
        row in a micro-batch of ``model_forward_micro_batch_size`` rows at its length rounded up
        to :meth:`fixed_width_multiple`."""
        multiple = self.fixed_width_multiple()
        if multiple is None:
            return None
        return FixedShapes(rows=self.model_forward_micro_batch_size, multiple=multiple)

    def preferred_batch_sizes(self, world_size: int) -> tuple[int, ...]:
        """Triton's preferred batch sizes: each ``inference_micro_batch_size`` times the ranks."""
        return tuple(int(s) * world_size for s in self.inference_micro_batch_size)

    def check_batching(self, world_size: int, key: str = "{section}") -> None:
        """Refuse batcher settings Triton cannot load on ``world_size`` ranks: a preferred batch size
        (see :meth:`preferred_batch_sizes`) above ``max_batch_size``. Triton refuses such a model
        config, and its python backend then crashes (glibc ``double free or corruption``) and the
        start times out minutes later instead of saying why. ``key`` names this section in the
        message.

        Raises:
            ValueError: naming ``{key}.max_batch_size`` and the smallest value that works.
        """
        largest = max(self.preferred_batch_sizes(world_size))
        if largest > self.max_batch_size:
            ranks = f" x {world_size} ranks" if world_size > 1 else ""
            raise ValueError(
                f"{key}.max_batch_size={self.max_batch_size} is below the batch size Triton is asked to "
                f"prefer, {largest} ({key}.inference_micro_batch_size={list(self.inference_micro_batch_size)}"
                f"{ranks}); set {key}.max_batch_size={largest} or more, or lower "
                f"{key}.inference_micro_batch_size"
            )

    def batching(self, world_size: int) -> Batching:
        """Triton's dynamic batcher for the batched endpoint, on ``world_size`` ranks."""
        return Batching(
            max_batch_size=self.max_batch_size,
            preferred_batch_sizes=self.preferred_batch_sizes(world_size),
            max_queue_delay_microseconds=int(self.max_queue_delay_microseconds),
        )

    def triton_host(self) -> TritonHost:
        """The Triton process and its HTTP front, not started."""
        return TritonHost(
            self.host,
            self.port,
            exit_timeout_s=self.exit_timeout_s,
            log_file=self.log_file,
            max_request_bytes=self.max_request_bytes,
            workspace_dir=self.workspace_dir,
        )
