"""The futures of the Tinker API: every mutating call is queued as a job and answered with a
``request_id`` the client polls (``retrieve_future``).

Owns :class:`FutureTable`: one worker thread runs the jobs in the order they arrived (so the calls
of one model apply in their ``seq_id`` order, and a sampler never reads weights an optimizer step
is writing), like jobs queued back to back run as one (:class:`Merge`), requests deduplicated by a
key (``(model_id, seq_id)``), results kept until fetched or expired, and failures sorted into the
client's fault (:class:`UserError`) or the server's. Must not know what a job computes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

LOGGER = logging.getLogger(__name__)
MERGE_WAIT_CAP = 20
"""A merging job waits for like jobs at most this many times :attr:`FutureTable.merge_wait_s`."""


def _done() -> Any:
    raise RuntimeError("this job has run")


class UserError(ValueError):
    """The request cannot be served as sent (answered as a failure of category ``user``, naming
    what was wrong and what is expected)."""


@dataclass(frozen=True)
class Merge:
    """How a job may run as one with the jobs queued directly behind it.

    The worker takes a job with a ``Merge`` together with the jobs right behind it (never past
    one without) whose ``group`` is equal, while their ``rows`` add up to at most the table's
    ``max_merged_rows``, and calls the first one's ``run`` once with their ``item``\\ s in
    submission order. ``run`` returns one callable per item, each returning that job's result or
    raising its error. When ``run`` itself raises, every job of the run is run alone instead (its
    own ``work``), so one job's fault fails only that job.
    """

    group: Hashable  # equal groups may run as one
    rows: int  # this job's share of a merged run's size
    item: Any  # what ``run`` is given for this job
    run: Callable[[Sequence[Any]], Sequence[Callable[[], Any]]]


@dataclass
class Job:
    """One queued call: its future, its work, and what it was asked under (for deduplication)."""

    request_id: str
    future: Future[Any]
    key: Hashable | None
    fingerprint: bytes | None
    work: Callable[[], Any]
    merge: Merge | None = None
    created_s: float = field(default_factory=time.monotonic)


class FutureTable:
    """Jobs run one at a time on a worker thread; results wait to be fetched.

    Args:
        keep: how many finished jobs are remembered (the oldest are forgotten first).
        max_merged_rows: the most rows (:attr:`Merge.rows`, summed) one merged run takes; a job
            with more runs alone.
        merge_wait_s: how long a merging job waits, when the queue behind it is empty, for the
            next like job to arrive — counted again from each one taken, at most
            :data:`MERGE_WAIT_CAP` times this in all (a client's calls sent together reach the
            server ms apart, a burst of 64 over up to 0.2 s, and the first would otherwise run
            alone or with only a part of them); 0: no wait. Jobs without a ``Merge`` never wait.
    """

    def __init__(self, keep: int = 4096, max_merged_rows: int = 64, merge_wait_s: float = 0.0) -> None:
        if max_merged_rows < 1:
            raise ValueError(f"max_merged_rows must be >= 1, got {max_merged_rows}")
        if not merge_wait_s >= 0:
            raise ValueError(f"merge_wait_s must be >= 0, got {merge_wait_s}")
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._keys: dict[Hashable, str] = {}
        self._queue: deque[Job] = deque()  # submitted, not yet taken by the worker
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._closed = False
        self.keep = keep
        self.max_merged_rows = max_merged_rows
        self.merge_wait_s = merge_wait_s
        self._worker = threading.Thread(target=self._loop, name="openaligner-tinker-compute", daemon=True)
        self._worker.start()

    def submit(
        self,
        work: Callable[[], Any],
        *,
        key: Hashable | None = None,
        fingerprint: bytes | None = None,
        merge: Merge | None = None,
    ) -> str:
        """Queue ``work`` and return its request id; a second submission under the same ``key``
        returns the first one's id without running anything again. With ``merge``, ``work`` may
        instead run as part of a merged run (see :class:`Merge`); ``work`` stays what it runs
        alone.

        Raises:
            UserError: ``key`` was submitted before with another ``fingerprint`` (another body
                under the same ``seq_id``).
            RuntimeError: the table is closed.
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
            if self._closed:
                raise RuntimeError("the server is stopping: no new jobs are taken")
            request_id = uuid.uuid4().hex
            job = Job(request_id, Future(), key, fingerprint, work, merge)
            self._jobs[request_id] = job
            if key is not None:
                self._keys[key] = request_id
            self._queue.append(job)
            self._ready.notify()
            self._forget_old()
            return request_id

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                batch = self._take()
            self._execute(batch)

    def _take(self) -> list[Job]:
        """The next job and, if it merges, the like jobs queued directly behind it, waiting up to
        :attr:`merge_wait_s` for more while the queue is empty (lock held; released while waiting)."""
        first = self._queue.popleft()
        batch = [first]
        if first.merge is None:
            return batch
        rows = first.merge.rows
        start = time.monotonic()
        deadline = start + self.merge_wait_s
        cap = start + MERGE_WAIT_CAP * self.merge_wait_s
        while rows < self.max_merged_rows and not self._closed:
            if not self._queue:
                remaining = min(deadline, cap) - time.monotonic()
                if remaining <= 0:
                    break
                self._ready.wait(remaining)
                continue
            nxt = self._queue[0].merge
            if nxt is None or nxt.group != first.merge.group or rows + nxt.rows > self.max_merged_rows:
                break
            rows += nxt.rows
            batch.append(self._queue.popleft())
            deadline = time.monotonic() + self.merge_wait_s  # the burst goes on: wait for its next call
        return batch

    def _execute(self, batch: list[Job]) -> None:
        try:
            self._run_batch([job for job in batch if job.future.set_running_or_notify_cancel()])
        finally:
            for job in batch:  # a finished job is remembered by its future only: what it computed
                job.work = _done  # on (datums, models, samplers) is not kept for `keep` more jobs
                job.merge = None

    def _run_batch(self, batch: list[Job]) -> None:
        if batch and batch[0].merge is not None:
            LOGGER.debug(
                "a merged run of %d jobs, %d rows, submitted over %.3f s",
                len(batch),
                sum(j.merge.rows for j in batch if j.merge),
                batch[-1].created_s - batch[0].created_s,
            )
        if len(batch) == 1:
            self._settle(batch[0].future, batch[0].work)
            return
        if not batch:
            return
        merge = batch[0].merge
        assert merge is not None
        try:
            outcomes = list(merge.run([job.merge.item for job in batch if job.merge is not None]))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a merged run of {len(batch)} jobs returned {len(outcomes)} outcomes")
        except BaseException:  # whatever it was, each job still gets an answer (the worker lives on)
            LOGGER.warning("a merged run of %d jobs failed: each runs alone", len(batch), exc_info=True)
            outcomes = [job.work for job in batch]
        for job, outcome in zip(batch, outcomes, strict=True):
            self._settle(job.future, outcome)

    @staticmethod
    def _settle(future: Future[Any], work: Callable[[], Any]) -> None:
        try:
            result = work()
        except UserError as e:
            future.set_exception(e)
        except BaseException as e:  # a job's failure is its future's, never the worker's
            if isinstance(e, Exception):
                LOGGER.exception("a Tinker job failed")
            future.set_exception(e)
        else:
            future.set_result(result)

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
        """Stop taking jobs; the one running finishes (nothing is left half-applied), the queued
        ones are cancelled."""
        with self._ready:
            self._closed = True
            pending, self._queue = list(self._queue), deque()
            self._ready.notify_all()
        for job in pending:
            job.future.cancel()
        if threading.current_thread() is not self._worker:
            self._worker.join()
