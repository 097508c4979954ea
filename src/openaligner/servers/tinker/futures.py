"""The futures of the Tinker API: every mutating call is queued as a job and answered with a
``request_id`` the client polls (``retrieve_future``).

Owns :class:`FutureTable`: one worker thread runs the jobs in the order they arrived (so the calls
of one model apply in their ``seq_id`` order, and a sampler never reads weights an optimizer step
is writing), requests deduplicated by a key (``(model_id, seq_id)``), results kept until fetched
or expired, and failures sorted into the client's fault (:class:`UserError`) or the server's.
Must not know what a job computes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

LOGGER = logging.getLogger(__name__)


class UserError(ValueError):
    """The request cannot be served as sent (answered as a failure of category ``user``, naming
    what was wrong and what is expected)."""


@dataclass
class Job:
    """One queued call: its future and what it was asked under (for deduplication)."""

    request_id: str
    future: Future[Any]
    key: Hashable | None
    fingerprint: bytes | None
    created_s: float = field(default_factory=time.monotonic)


class FutureTable:
    """Jobs run one at a time on a worker thread; results wait to be fetched.

    Args:
        keep: how many finished jobs are remembered (the oldest are forgotten first).
    """

    def __init__(self, keep: int = 4096) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openaligner-tinker-compute")
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._keys: dict[Hashable, str] = {}
        self._lock = threading.Lock()
        self.keep = keep

    def submit(
        self, work: Callable[[], Any], *, key: Hashable | None = None, fingerprint: bytes | None = None
    ) -> str:
        """Queue ``work`` and return its request id; a second submission under the same ``key``
        returns the first one's id without running anything again.

        Raises:
            UserError: ``key`` was submitted before with another ``fingerprint`` (another body
                under the same ``seq_id``).
        """
        with self._lock:
            if key is not None and key in self._keys:
                known = self._jobs.get(self._keys[key])
                if known is not None:
                    if fingerprint is not None and known.fingerprint not in (None, fingerprint):
                        raise UserError(
                            f"request {key} was already submitted with another body; each seq_id names "
                            "one request"
                        )
                    return known.request_id
            request_id = uuid.uuid4().hex
            future: Future[Any] = self._executor.submit(self._run, work)
            self._jobs[request_id] = Job(request_id, future, key, fingerprint)
            if key is not None:
                self._keys[key] = request_id
            self._forget_old()
            return request_id

    @staticmethod
    def _run(work: Callable[[], Any]) -> Any:
        try:
            return work()
        except UserError:
            raise
        except Exception:
            LOGGER.exception("a Tinker job failed")
            raise

    def get(self, request_id: str) -> Future[Any] | None:
        """The future of ``request_id`` (None: unknown or forgotten)."""
        with self._lock:
            job = self._jobs.get(request_id)
            return None if job is None else job.future

    def _forget_old(self) -> None:
        while len(self._jobs) > self.keep:
            oldest_id, oldest = next(iter(self._jobs.items()))
            if not oldest.future.done():
                return
            del self._jobs[oldest_id]
            if oldest.key is not None and self._keys.get(oldest.key) == oldest_id:
                del self._keys[oldest.key]

    def close(self) -> None:
        """Stop taking jobs; the one running finishes (nothing is left half-applied)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
