"""Weights by collective (``rollout.vllm.weight_transfer=collective``): the state dict broadcast in
buckets over a two-member process group of the trainer (rank 0) and one engine, gloo on the CPU
or NCCL where the engine has a GPU; the group is built on the first push and again after a failure.

Owns :class:`CollectiveWeights`, the collective half of an :class:`~openaligner.rollout.vllm_link.EngineLink`
(it talks to its engine through the link's ``post``). Must not know when weights go out.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.request
from typing import Any

import torch

from openaligner.rollout.engine import RolloutEngineError
from openaligner.rollout.vllm_config import check_engine_url

log = logging.getLogger(__name__)


class CollectiveWeights:
    """The process group with one engine and the pushes over it; mixed into ``EngineLink``,
    whose ``url``, ``request_timeout_s`` and ``post`` it uses."""

    url: str
    request_timeout_s: float
    # the process group with the engine (rank 0 here), its store, and the device the buckets are
    # sent from; None until the first push (and after a failure)
    _group: Any = None
    _store: Any = None
    _device = torch.device("cpu")

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        raise NotImplementedError  # the link's

    def send_collective(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Broadcast ``tensors`` (as the engine loads them) over the process group with the engine
        and have it reload from them. The plan first (``POST /collective/plan``, checked by the
        engine before any byte moves); then ``POST /collective/receive`` in a thread, and only once
        the engine has set the store key ``ready/<push>`` (or answered: a refusal) the buckets of
        :func:`~openaligner.rollout.vllm_worker.bucket_layout` are broadcast from ``device`` (the
        trainer's; the CPU for gloo). The group is built on the first push, and again when the
        engine has lost its end (409) or a broadcast failed."""
        import uuid

        import torch.distributed as tdist

        from openaligner.rollout.vllm_worker import COLLECTIVE_BUCKET_BYTES, bucket_bytes_of, bucket_layout

        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's current device (on_each runs a thread each)
        if self._group is None:
            self._init_collective(device)
        push = uuid.uuid4().hex
        values = list(tensors.values())
        specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
        plan = {"push": push, "tensors": specs, "bucket_bytes": COLLECTIVE_BUCKET_BYTES}
        try:
            self.post("/collective/plan", plan)
        except RolloutEngineError as e:
            if e.status != 409:  # a refused plan (400, 413): the engine's answer, the group is fine
                raise
            # the engine lost its end (a receive that failed, a restart): build anew, once
            self._end_collective()
            self._init_collective(device)
            self.post("/collective/plan", plan)
        answer: dict[str, Any] = {}

        def receive() -> None:
            try:
                answer["reply"] = self.post("/collective/receive", {})
            except RolloutEngineError as e:
                answer["error"] = e

        receiver = threading.Thread(target=receive, name="vllm-receive", daemon=True)
        receiver.start()
        # broadcast only to an engine that is receiving: a send to one that refused would block
        # until the group's timeout
        deadline = time.monotonic() + self.request_timeout_s
        while not self._store.check([f"ready/{push}"]):
            if not receiver.is_alive() or time.monotonic() > deadline:
                receiver.join(timeout=1.0)
                self._end_collective()
                raise answer.get("error") or RolloutEngineError(
                    f"the vllm rollout engine at {self.url} did not start receiving the weights within "
                    f"rollout.vllm.request_timeout_s={self.request_timeout_s:g}"
                )
            time.sleep(0.002)
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        sizes = [t.numel() * t.element_size() for t in values]
        try:
            for bucket in bucket_layout(sizes, COLLECTIVE_BUCKET_BYTES):
                buf = torch.empty(bucket_bytes_of(bucket), dtype=torch.uint8, device=self._device)
                for index, offset, n in bucket:
                    buf[offset : offset + n].copy_(values[index].reshape(-1).view(torch.uint8))
                self._group.broadcast([buf], opts).wait()
        except RuntimeError as e:
            self._end_collective()
            receiver.join(timeout=10.0)
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} did not take the weights over the collective "
                f"group: {answer.get('error') or e}"
            ) from None
        receiver.join()
        if "error" in answer:
            self._end_collective()
            raise answer["error"]

    def _init_collective(self, device: torch.device) -> None:
        """Build the two-member process group with the engine: a TCP store here (rank 0), on the
        address this machine reaches the engine from; the engine joins it (``POST
        /collective/init``, in a thread) and sets the key ``joining``; only then this side builds
        its end (so a refusal leaves nothing waiting). Gloo, or NCCL where the engine has a GPU:
        then ``device`` (the trainer's) must be another GPU than the engine's."""
        import datetime

        import torch.distributed as tdist

        host, port = check_engine_url(self.url, "rollout.vllm.url")
        try:
            with urllib.request.urlopen(self.url + "/info", timeout=30.0) as r:
                info = dict(json.loads(r.read()))
            backend = info.get("collective_backend", "gloo")
            with socket.create_connection((host, port), timeout=30.0) as s:
                here = s.getsockname()[0]  # this machine's address on the route to the engine
        except (OSError, http.client.HTTPException, ValueError, TypeError) as e:
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} did not answer GET /info ({type(e).__name__}: {e})"
            ) from None
        if backend == "nccl":
            if device.type != "cuda":
                raise RolloutEngineError(
                    f"the vllm rollout engine at {self.url} has a GPU (its weights come over NCCL) and this "
                    "trainer runs on the CPU: set rollout.vllm.weight_transfer=auto"
                )
            if info.get("gpu_uuid") == str(torch.cuda.get_device_properties(device).uuid):
                raise RolloutEngineError(
                    f"the vllm rollout engine at {self.url} runs on this trainer's GPU, and NCCL cannot join "
                    "two processes on one GPU: set rollout.vllm.weight_transfer=auto (through /dev/shm) "
                    "or give the engine GPUs of its own"
                )
        self._device = device if backend == "nccl" else torch.device("cpu")
        timeout_s = min(self.request_timeout_s, 86400.0)  # the engine's limit for a group's timeout
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = tdist.TCPStore(here, 0, 2, True, timeout, wait_for_workers=False)
        except (RuntimeError, ValueError, OSError) as e:
            raise RolloutEngineError(
                f"no store for the collective group with {self.url} on {here}: {e}"
            ) from None
        answer: dict[str, Any] = {}

        def join() -> None:
            try:
                answer["reply"] = self.post(
                    "/collective/init", {"host": here, "port": store.port, "timeout_s": timeout_s}
                )
            except RolloutEngineError as e:
                answer["error"] = e

        joiner = threading.Thread(target=join, name="vllm-group", daemon=True)
        joiner.start()
        while not store.check(["joining"]):
            if not joiner.is_alive():  # answered before joining: a refusal
                raise answer.get("error") or RolloutEngineError(
                    f"the vllm rollout engine at {self.url} did not join the collective group"
                )
            time.sleep(0.002)
        prefixed = tdist.PrefixStore("openaligner-weights", store)
        try:
            if backend == "nccl":
                options = tdist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group: Any = tdist.ProcessGroupNCCL(prefixed, 0, 2, options)
            else:
                group = tdist.ProcessGroupGloo(prefixed, 0, 2, timeout)
        except RuntimeError as e:
            joiner.join(timeout=10.0)
            why = answer.get("error") or e
            raise RolloutEngineError(
                f"the process group with the vllm rollout engine at {self.url} failed: {why}"
            ) from None
        joiner.join()
        if "error" in answer:
            raise answer["error"]
        self._group, self._store = group, store
        log.info(
            "vllm rollout engine %s: weights pushed over a %s group (%s:%d)",
            self.url,
            backend,
            here,
            store.port,
        )

    def _end_collective(self) -> None:
        """Drop the group with the engine (NCCL's shut down); the next push builds a new one."""
        shutdown = getattr(self._group, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        self._group = self._store = None
