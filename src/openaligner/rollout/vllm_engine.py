"""The ``vllm`` rollout engine, trainer side: starts one vLLM engine process with the rollout
environment's Python (or attaches to those ``openaligner serve-rollout`` started), talks to them
over HTTP, and pushes the policy's weights into them (file, upload, or a group broadcast).

Owns the engine process's lifecycle (its whole process group is ended on :meth:`close`; the
engine also ends itself when the trainer's process is gone; attached engines are only detached),
the model directory the engine loads from, the mapping of
:class:`~openaligner.models.generation.SamplingParams` onto vLLM's, and the weight push. Must not
import vLLM (it lives in another virtualenv) nor know about rewards, losses or the PPO loop.
Engine side: ``vllm_worker.py``; the why and the wire: docs/rollout-engine.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from openaligner import distributed as dp
from openaligner.rollout.engine import (
    EngineSetupError,
    RolloutEngine,
    RolloutEngineError,
    RolloutRequest,
    VLLMConfig,
    VLLMProcessConfig,
    WeightSource,
    check_engine_url,
    engine_urls,
)

if TYPE_CHECKING:
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import Generation

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
"""The script the engine process runs (stdlib + vLLM only)."""

LEASE_HEADER = "X-Openaligner-Lease"
"""The header carrying an attached trainer's lease (``vllm_worker.LEASE_HEADER``)."""

S = TypeVar("S")
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_python(spec: str, key: str = "rollout.vllm.python") -> Path:
    """The rollout environment's interpreter: ``spec`` if absolute, else relative to the working
    directory, else to the source checkout holding this package (where ``make rollout-setup``
    puts ``.venv-rollout``).

    Raises:
        EngineSetupError: no such interpreter, naming the key and the make target.
    """
    path = Path(spec).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, Path(__file__).parents[3] / path]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.absolute()  # not resolved: a venv's python is a symlink out of the venv
    raise EngineSetupError(
        f"{key}={spec} is not an interpreter (looked at {', '.join(map(str, candidates))}): "
        f"run `make rollout-setup` (a virtualenv with vLLM in .venv-rollout) or point {key} "
        "at a Python that can import vllm"
    )


def engine_state_dict(
    state: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool, *, own_copies: bool = True
) -> dict[str, torch.Tensor]:
    """``state`` as the engine loads it: floats cast to ``dtype``, every tensor contiguous, with an
    explicit ``lm_head.weight`` for a model whose head is tied to its input embedding (vLLM's CPU
    build keeps a packed copy of the head that a reload without that key leaves stale).

    ``own_copies`` (a file's tensors): each its own CPU copy, since safetensors refuses tensors
    that share memory, and tied weights do. Without it (a broadcast, which copies every tensor
    into its buckets anyway) tensors stay on their device and share memory where they can."""
    out = {}
    for name, t in state.items():
        t = t.detach().to(dtype=dtype if t.is_floating_point() else t.dtype)
        out[name] = t.to("cpu").clone().contiguous() if own_copies else t.contiguous()
    if tied and "lm_head.weight" not in out:
        embed = [n for n in out if n.endswith("embed_tokens.weight") or n.endswith("wte.weight")]
        if embed:
            head = out[embed[0]]
            out["lm_head.weight"] = head.clone() if own_copies else head
    return out


def shm_dir(prefix: str) -> Path:
    """A new private directory in ``/dev/shm`` (memory, not disk) when there is one, else in the
    temporary directory."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))


def spawn_worker(
    python: Path,
    model_dir: Path,
    workdir: Path,
    cfg: VLLMProcessConfig,
    stdout: Any,
    extra: list[str],
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``vllm_worker.py`` with ``python`` on ``model_dir``, in its own session (its process
    group is ended as one by :func:`end_group`), exiting by itself when this process is gone.
    Returns the process and the ready file it writes once it serves (``{"port": N}``)."""
    ready = workdir / "ready.json"
    cmd = [
        str(python),
        "-I",  # no PYTHONPATH, no user site, and not this package's directory on sys.path
        str(WORKER),
        f"--model={model_dir}",
        f"--ready-file={ready}",
        f"--dtype={cfg.dtype}",
        f"--tensor-parallel-size={cfg.tensor_parallel_size}",
        f"--gpu-memory-utilization={cfg.gpu_memory_utilization}",
        f"--max-model-len={cfg.max_model_len}",
        "--enforce-eager" if cfg.enforce_eager else "--no-enforce-eager",
        f"--parent-pid={os.getpid()}",
        f"--workdir={workdir}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib)}
    if cfg.tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the server's process
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, ready


class EngineLink:
    """One engine process the run talks to (rank 0 only): its URL and, for an engine the run
    started, its process and log; for an attached one, its ``GET /info``, the lease every request
    carries (kept by a heartbeat thread) and its weights directory when it is on this machine."""

    def __init__(self, url: str, request_timeout_s: float, info: dict[str, Any] | None = None) -> None:
        self.url = url  # as engine_urls gives it (no trailing slash); "" until a started engine serves
        self.request_timeout_s = request_timeout_s
        self.info: dict[str, Any] = info or {}
        self.proc: subprocess.Popen[bytes] | None = None  # started by the run: its process
        self.log_path: Path | None = None
        self.lease = ""  # attached: the lease every request carries
        self.local_dir: Path | None = None  # attached: the engine's weights directory, if writable here
        self._beating: threading.Event | None = None  # set to stop the heartbeat thread
        # weight_transfer=collective: the process group with the engine (rank 0 here), its store,
        # and the device the buckets are sent from; None until the first push (and after a failure)
        self._group: Any = None
        self._store: Any = None
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ attaching
    def attach(self, weight_transfer: str) -> None:
        """Take the engine's lease; the weights go through its directory when it is on this
        machine (this process can read the engine's token file there) and ``weight_transfer`` is
        ``auto``, else as an upload."""
        token: str | None = None
        with contextlib.suppress(OSError, TypeError, KeyError):
            token = (Path(self.info["workdir"]) / "local-token").read_text().strip()
        out = self.post("/attach", {"client": f"{socket.gethostname()}:{os.getpid()}", "local_token": token})
        self.lease = str(out["lease"])
        weights_dir = Path(out["weights_dir"])
        local = bool(out["local"]) and weight_transfer == "auto" and os.access(weights_dir, os.W_OK)
        self.local_dir = weights_dir if local else None
        every = max(1.0, float(self.info.get("lease_ttl_s", 60.0)) / 4)
        self._beating = threading.Event()
        beat = (self._beating, every, self.url, self.lease)
        threading.Thread(target=self._heartbeat, args=beat, name="vllm-lease", daemon=True).start()
        how = {"collective": "broadcast over a process group", "http": "uploaded over HTTP"}.get(
            weight_transfer, f"written into {weights_dir}" if local else "uploaded over HTTP"
        )
        log.info("vllm rollout engine: attached to %s (weights %s)", self.url, how)

    @staticmethod
    def _heartbeat(stop: threading.Event, every: float, url: str, lease: str) -> None:
        """Keep the lease while the run is busy elsewhere (long training phases); a beat that
        fails is only skipped (the run's own next request says what is wrong)."""
        while not stop.wait(every):
            req = urllib.request.Request(
                url + "/heartbeat", data=b"{}", headers={LEASE_HEADER: lease}, method="POST"
            )
            with contextlib.suppress(Exception), urllib.request.urlopen(req, timeout=every):
                pass

    def detach(self) -> None:
        """Give the lease back (the engine keeps serving); a no-op when none is held."""
        self._end_collective()
        if self._beating is not None:
            self._beating.set()
            self._beating = None
        if self.lease:
            with contextlib.suppress(RolloutEngineError):
                self.post("/detach", {}, timeout=30.0)
            log.info("vllm rollout engine: detached from %s (it keeps serving)", self.url)
        self.lease = ""

    # ------------------------------------------------------------------ weights
    def take_weights(self, staged: Path) -> None:
        """Hand the engine ``staged`` (a whole ``model.safetensors``) and have it reload: into
        its own directory when it is on this machine (a hard link where the file system allows,
        renamed into place: never seen half-written), else streamed as ``PUT /weights``."""
        if self.local_dir is not None:
            tmp = self.local_dir / "model.safetensors.tmp"  # not *.safetensors: never read half-written
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            try:
                os.link(staged, tmp)
            except OSError:  # another file system, or one without hard links
                shutil.copyfile(staged, tmp)
            os.replace(tmp, self.local_dir / "model.safetensors")
        else:
            self._upload(staged)
        self.post("/reload_weights", {})  # from its weights directory

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

    def _upload(self, path: Path) -> None:
        """``PUT /weights``: ``path`` streamed with its size; the engine refuses a body of another
        size."""
        size = path.stat().st_size
        host, port = check_engine_url(self.url, "rollout.vllm.url")
        conn = http.client.HTTPConnection(host, port, timeout=self.request_timeout_s)
        try:
            with path.open("rb") as f:
                headers = {
                    "Content-Length": str(size),
                    "Content-Type": "application/octet-stream",
                    LEASE_HEADER: self.lease,
                }
                conn.request("PUT", "/weights", body=f, headers=headers)
                reply = conn.getresponse()
                payload = reply.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} did not take the weights (PUT /weights, {size} "
                f"bytes): {type(e).__name__}: {e}"
            ) from None
        finally:
            conn.close()
        if reply.status != 200:
            raise RolloutEngineError(f"the vllm rollout engine at {self.url} refused PUT /weights: {payload}")

    # ------------------------------------------------------------------ transport
    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """``POST path`` with the JSON ``body``; its JSON object answer, or a
        :class:`RolloutEngineError` naming this engine (a refusal's message, an engine that died,
        one that did not answer within ``timeout``, or an answer that is not a JSON object)."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.lease:
            headers[LEASE_HEADER] = self.lease
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            refused = RolloutEngineError(f"the vllm rollout engine at {self.url} refused {path}: {detail}")
            refused.status = e.code
            raise refused from None
        except (OSError, http.client.HTTPException) as e:
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=2.0)  # a connection reset arrives before the exit status
            if self.proc is not None and self.proc.poll() is not None:
                raise RolloutEngineError(
                    f"the vllm rollout engine died during {path}: {self.describe_exit()}"
                ) from None
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} did not answer {path} "
                f"({type(e).__name__}: {e}; rollout.vllm.request_timeout_s={self.request_timeout_s:g})"
            ) from None
        try:
            reply = json.loads(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            # a KeyError or JSONDecodeError here would leave the other ranks waiting in _on_leader
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} answered {path} with other than a JSON object: "
                f"{raw[:200]!r}"
            )
        return reply

    def describe_exit(self) -> str:
        assert self.proc is not None
        rc = self.proc.returncode
        how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
        return f"process {self.proc.pid} ended ({how}); its log ends:\n{self.log_tail()}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            assert self.log_path is not None
            text = self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def split_rows(rows: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of ``range(rows)``, sizes differing by at most one, larger
    first (an engine may get none when there are fewer rows than engines)."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (i < extra)
        out.append(slice(start, start + n))
        start += n
    return out


def on_each(items: list[S], work: Callable[[S], T]) -> list[T]:
    """``work(item)`` for every item, at once (a thread each: the engines work in parallel), the
    results in ``items``' order; the first failure (in that order) is raised once all ended."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(len(items), thread_name_prefix="vllm-engine") as pool:
        futures = [pool.submit(work, item) for item in items]
        concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class VLLMRolloutEngine(RolloutEngine):
    """Rollouts from vLLM engines in their own processes (``rollout.engine=vllm``).

    Sampling means what it means for the ``hf`` engine: temperature, top-k, top-p, min and max
    new tokens and the stop ids (the tokenizer's EOS included; only they end a response, and
    ``min_new_tokens`` bans exactly them); greedy is vLLM's temperature 0. Stop strings: the
    engine cannot match them (it runs without a tokenizer), so a response is cut after generation
    where the ``hf`` loop would have ended it (:func:`~openaligner.models.generation.stop_string_length`).
    Seeds: row ``i`` is sampled from its own stream seeded with
    ``seeds[i]``, so a row's tokens do not depend on its batch-mates (nor on which engine drew it).

    Weights: :meth:`start` writes the policy's weights and the model's config to a directory in
    ``/dev/shm`` and starts the engine on it. :meth:`update_weights` only records that the weights
    changed; the next :meth:`generate` writes them (``policy.inference_state_dict()``: LoRA merged,
    shards gathered) as ``model.safetensors`` there and has the engine reload them and drop its
    prefix cache — once, however many optimizer steps came between. The time it takes is
    ``timing/weight_sync_s``. The first rollout after a push checks the engine's log-probs against
    the trainer's (:meth:`check_logprobs`).

    Engines: one the run starts, or the standalone engines ``rollout.vllm.url`` lists (one or
    more ``openaligner serve-rollout``). Rank 0 talks to them: under torchrun every rank's rows
    go out in one round (each engine gets a contiguous share, all at once) and each rank gets its
    own rows back; a push reaches every engine before the next rollout. The metrics are over every
    rank's rows.
    """

    name = "vllm"
    shares_weights = False

    def __init__(self, actor: CausalLMActor, cfg: VLLMConfig) -> None:
        """Raises :class:`EngineSetupError` when the engine cannot be started (no interpreter) or,
        with ``cfg.url``, attached to (nothing answers at one of its URLs, one serves another
        architecture or vocabulary, or another trainer holds it)."""
        self.cfg = cfg
        self.attached = cfg.url is not None  # attach to engines of `openaligner serve-rollout`
        self.python = None if self.attached else resolve_python(cfg.python)
        self.dtype = cfg.dtype  # of the weights pushed: the engine's (an attached one reports it)
        self.policy: WeightSource = actor
        self.device = actor.device  # the trainer's: a collective push over NCCL is sent from it
        self.pad_id = int(actor.pad_id)
        self.tokenizer = actor.tokenizer
        self.hf_config = _plain_config(actor)
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self.links: list[EngineLink] = []  # rank 0, once started: the engines it talks to
        self.started = False  # every rank: the engines serve (and, attached, are leased)
        self.workdir: Path | None = None  # an engine the run starts: its directory
        self.version = 0
        self._dirty = False  # the policy changed since the engine's weights were written
        self._check_next = False  # the next rollout is the first after a push: check its log-probs
        self._sync_s = 0.0
        self._syncs = 0
        self._urls = engine_urls(cfg.url) if cfg.url is not None else []  # attached: the engines
        self._infos = [self._probe(url) for url in self._urls]  # and each one's GET /info
        if self._urls:
            workdirs = [info.get("workdir") for info in self._infos]
            twice = [
                u
                for u, w in zip(self._urls, workdirs, strict=True)
                if w is not None and workdirs.count(w) > 1
            ]
            if twice:
                raise EngineSetupError(
                    f"rollout.vllm.url={cfg.url}: {' and '.join(twice)} are one engine (the same "
                    "working directory): list each engine once"
                )
            dtypes = {info["dtype"] for info in self._infos}
            if len(dtypes) > 1:
                raise EngineSetupError(
                    f"rollout.vllm.url={cfg.url}: the engines compute in different dtypes "
                    f"({', '.join(sorted(dtypes))}): one run's rollouts must come from one model; start "
                    "them with the same vllm.dtype"
                )
            self.dtype = dtypes.pop()

    @property
    def url(self) -> str:
        """The engines' URLs, comma-separated (rank 0, once started; else ``""``)."""
        return ",".join(link.url for link in self.links)

    # ------------------------------------------------------------------ attaching
    def _probe(self, url: str) -> dict[str, Any]:
        """``GET /info`` of the engine at ``url`` (one of ``rollout.vllm.url``), checked against
        the actor and for a lease held by another trainer.

        Raises:
            EngineSetupError: naming ``rollout.vllm.url`` and what is wrong.
        """
        several = len(self._urls) > 1
        where = f"{url} (of rollout.vllm.url)" if several else f"rollout.vllm.url={self.cfg.url}"
        try:
            with urllib.request.urlopen(url + "/info", timeout=min(30.0, self.cfg.request_timeout_s)) as r:
                info = dict(json.loads(r.read()))
            model, lease = dict(info["model"]), info["lease"]
            _DTYPES[info["dtype"]]  # one this side can cast to
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            raise EngineSetupError(
                f"{where}: no vllm rollout engine answers there ({type(e).__name__}: {e}); start one with "
                "`openaligner serve-rollout model=DIR` and set the URL it prints"
            ) from None
        if not info.get("standalone"):
            raise EngineSetupError(
                f"{where} is an engine another run started for itself, not one of openaligner serve-rollout"
            )
        mine = self.hf_config.to_dict()
        differ = [
            f"{k} {v!r} (the actor's: {mine[k]!r})"
            for k, v in model.items()
            if mine.get(k) is not None and v is not None and v != mine[k]
        ]
        if differ:
            raise EngineSetupError(
                f"{where} serves another model than the actor: {', '.join(differ)}; its weights cannot "
                "take the actor's: start openaligner serve-rollout on the actor's model (or one of its "
                "architecture and vocabulary)"
            )
        if lease is not None and float(lease["idle_s"]) < float(info.get("lease_ttl_s", 0)):
            raise EngineSetupError(
                f"{where} is attached to another trainer ({lease['holder']}, last request "
                f"{float(lease['idle_s']):.0f} s ago): two runs would overwrite each other's weights; stop "
                "that run, or start another engine with openaligner serve-rollout"
            )
        return info

    def _attach(self) -> str:
        """Take every engine's lease (rank 0); if one refuses, those taken are given back."""
        links = [
            EngineLink(url, self.cfg.request_timeout_s, info)
            for url, info in zip(self._urls, self._infos, strict=True)
        ]
        try:
            for link in links:
                link.attach(self.cfg.weight_transfer)
        except RolloutEngineError:
            for link in links:
                link.detach()
            raise
        self.links = links
        return self.url

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Write the policy's weights, start the engine on them (rank 0) and wait until it serves.
        Every rank calls it (gathering a sharded policy's weights is a collective)."""
        if self.started:
            return
        if self.attached:
            # the engines may hold another run's weights, or this run's before a resume: the first
            # rollout pushes the actor's, and is checked against them
            _on_leader(self._attach)
            self.started = self._dirty = True
            return
        state = self.policy.inference_state_dict()
        _on_leader(lambda: self._start(state))
        self.started = True

    def _start(self, state: dict[str, torch.Tensor] | None) -> str:
        self.workdir = shm_dir("openaligner-vllm-")
        model_dir = self.workdir / "model"
        model_dir.mkdir()
        self.hf_config.save_pretrained(model_dir)
        self._write_weights(model_dir, state)
        c = self.cfg
        assert self.python is not None
        link = EngineLink("", c.request_timeout_s)
        link.log_path = self.workdir / "engine.log"
        with link.log_path.open("wb") as log_file:
            link.proc, ready = spawn_worker(self.python, model_dir, self.workdir, c, log_file, [])
        self.links = [link]  # stopped with the run, whatever happens next
        log.info("vllm rollout engine: starting (pid %d, log %s)", link.proc.pid, link.log_path)
        deadline = time.monotonic() + c.start_timeout_s
        while not ready.exists():
            if link.proc.poll() is not None:
                raise RolloutEngineError(f"the vllm rollout engine failed to start: {link.describe_exit()}")
            if time.monotonic() > deadline:
                tail = link.log_tail()
                self.stop()
                raise RolloutEngineError(
                    f"the vllm rollout engine did not serve within rollout.vllm.start_timeout_s="
                    f"{c.start_timeout_s:g}; its log ends:\n{tail}"
                )
            time.sleep(0.2)
        port = json.loads(ready.read_text())["port"]
        self._dirty = False
        link.url = f"http://127.0.0.1:{port}"
        log.info("vllm rollout engine: serving on %s", link.url)
        return link.url

    def stop(self) -> None:
        """End a started engine's whole process group (SIGTERM, then SIGKILL after 15 s) and
        remove its directory; attached engines are detached from (their leases given back) and
        keep serving."""
        links, self.links, self.started = self.links, [], False
        for link in links:
            link.detach()
            if link.proc is not None:
                end_group(link.proc)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    # ------------------------------------------------------------------ weights
    def update_weights(self, policy: WeightSource, version: int) -> None:
        """Record that the weights changed; the next :meth:`generate` pushes them (once)."""
        self.policy = policy
        self.version = version
        self._dirty = True

    def _write_weights(self, model_dir: Path, state: dict[str, torch.Tensor] | None) -> None:
        from safetensors.torch import save_file

        assert state is not None, "rank 0 holds the whole state dict"
        tensors = engine_state_dict(state, _DTYPES[self.dtype], self.tied)
        tmp = model_dir / "model.safetensors.tmp"  # not *.safetensors: never read half-written
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, model_dir / "model.safetensors")

    def _push(self) -> None:
        t0 = time.perf_counter()
        state = self.policy.inference_state_dict()  # a collective for a sharded policy

        def push() -> None:
            if self.cfg.weight_transfer == "collective":
                assert state is not None, "rank 0 holds the whole state dict"
                tensors = engine_state_dict(state, _DTYPES[self.dtype], self.tied, own_copies=False)
                on_each(self.links, lambda link: link.send_collective(tensors, self.device))
                return
            if not self.attached:
                assert self.workdir is not None
                model_dir = self.workdir / "model"
                self._write_weights(model_dir, state)
                self.links[0].post("/reload_weights", {"path": str(model_dir)})
                return
            # written once, then handed to every engine at once (linked into the directories of
            # those on this machine, uploaded to the others)
            staging = shm_dir("openaligner-push-")
            try:
                self._write_weights(staging, state)
                on_each(self.links, lambda link: link.take_weights(staging / "model.safetensors"))
            finally:
                shutil.rmtree(staging, ignore_errors=True)

        _on_leader(push)
        self._dirty = False
        self._check_next = True
        self._sync_s += time.perf_counter() - t0
        self._syncs += 1

    def pop_metrics(self) -> dict[str, float]:
        """``timing/weight_sync_s``: seconds spent pushing weights since the last call (gather,
        write, reload), when there was a push."""
        if not self._syncs:
            return {}
        out = {"timing/weight_sync_s": self._sync_s}
        self._sync_s, self._syncs = 0.0, 0
        return out

    # ------------------------------------------------------------------ generation
    def generate(self, request: RolloutRequest) -> Generation:
        from openaligner.models.generation import Generation, stop_string_length

        s = request.sampling
        if s.stop_strings and self.tokenizer is None:
            raise EngineSetupError(
                "stop strings (trainer.sampling.end_strings) need the actor's tokenizer to decode "
                "responses, and this actor has none"
            )
        assert s.stop_token_ids is not None, "a rollout request carries resolved stop ids"
        if not self.started:
            self.start()
        if self._dirty:
            self._push()
        plens = request.prompt_lengths.tolist()
        # every rank's rows go out in one round (rank 0 sends them); each rank takes its own back
        rows = dp.gather_objects(
            (
                [row[:n] for row, n in zip(request.prompts.tolist(), plens, strict=True)],
                request.seeds.tolist(),
            )
        )
        prompts = [p for ps, _ in rows for p in ps]
        seeds = [x for _, ss in rows for x in ss]
        settings = {
            "greedy": s.greedy,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "max_tokens": s.max_new_tokens,
            "min_tokens": s.min_new_tokens,
            "stop_token_ids": list(s.stop_token_ids),
        }
        out = _on_leader(lambda: self._generate_on_engines(prompts, seeds, settings))
        start = sum(len(ps) for ps, _ in rows[: dp.rank()])
        mine = slice(start, start + len(plens))
        responses, lps, finish = out["token_ids"][mine], out["logprobs"][mine], out["finish_reasons"][mine]
        if s.stop_strings:
            assert self.tokenizer is not None
            for i, resp in enumerate(responses):
                # the engine matches no strings (it has no tokenizer): it sampled on past a stop
                # string, and the response is cut where the hf engine's loop would have ended it
                n = stop_string_length(resp, s.stop_strings, s.min_new_tokens, self.tokenizer)
                if n is not None:
                    responses[i], lps[i], finish[i] = resp[:n], lps[i][:n], "stop"
        totals = [p + len(r) for p, r in zip(plens, responses, strict=True)]
        b, width = len(plens), max(totals)
        tokens = torch.full((b, width), self.pad_id, dtype=torch.int64)
        logprobs = torch.zeros(b, width - 1, dtype=torch.float32)
        for i, (p, resp, lp) in enumerate(zip(plens, responses, lps, strict=True)):
            tokens[i, :p] = request.prompts[i, :p]
            tokens[i, p : totals[i]] = torch.tensor(resp, dtype=torch.int64)
            logprobs[i, p - 1 : totals[i] - 1] = torch.tensor(lp, dtype=torch.float32)
        return Generation(
            tokens=tokens,
            sequence_lengths=torch.tensor(totals, dtype=torch.int64),
            prompt_lengths=request.prompt_lengths.to("cpu", torch.int64),
            is_end=torch.tensor([f == "stop" for f in finish], dtype=torch.bool),
            logprobs=logprobs,
        )

    def _generate_on_engines(
        self, prompts: list[list[int]], seeds: list[int], settings: dict[str, Any]
    ) -> dict[str, list[Any]]:
        """``POST /generate`` of every row (rank 0): each engine gets a contiguous share, all at
        once; their answers, checked, joined in the rows' order."""
        parts = split_rows(len(prompts), len(self.links))
        shares = [
            (link, part) for link, part in zip(self.links, parts, strict=True) if part.stop > part.start
        ]

        def one(share: tuple[EngineLink, slice]) -> dict[str, Any]:
            link, part = share
            body = {"prompts": prompts[part], "seeds": seeds[part], **settings}
            return check_generate_reply(link.post("/generate", body), part.stop - part.start, link.url)

        replies = on_each(shares, one)
        return {
            key: [x for r in replies for x in r[key]] for key in ("token_ids", "logprobs", "finish_reasons")
        }

    def check_logprobs(
        self, engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """The mismatch metrics; raises :class:`RolloutEngineError` when, on the first rollout
        after a weight push, the mean |Δ log p| exceeds ``rollout.vllm.max_logprob_diff`` (the
        engine generated from other weights than the trainer's), and warns when a later rollout
        does. Only without top-k/top-p truncation: with it, vLLM's log-probs are renormalised over
        the kept tokens and the trainer's are not, so they differ by design."""
        stats = _global_mismatch(engine_logprobs, trainer_logprobs, mask)
        just_pushed, self._check_next = self._check_next, False
        limit, mean = self.cfg.max_logprob_diff, stats["logprob_diff_mean"]
        sampling = getattr(self.policy, "sampling", None)
        truncated = sampling is not None and (sampling.top_k > 0 or sampling.top_p < 1.0)
        if limit > 0 and mean > limit and not truncated:
            message = (
                f"the vllm rollout engine's log-probs differ from the trainer's by {mean:.4g} nats per "
                f"token on average (max {stats['logprob_diff_max']:.4g}; rollout.vllm.max_logprob_diff="
                f"{limit:g})"
            )
            if just_pushed:
                raise RolloutEngineError(
                    f"{message} on the first rollout after pushing the weights of optimizer step "
                    f"{self.version}: the engine is not generating from the trainer's weights (raise the "
                    "limit only if the engine computes in a lower precision than the trainer)"
                )
            log.warning("%s", message)
        return stats


def check_generate_reply(out: dict[str, Any], rows: int, url: str | None) -> dict[str, Any]:
    """``out``, a ``POST /generate`` answer, if it holds ``rows`` rows of ``token_ids`` (non-negative
    integers), ``logprobs`` (one number per token) and ``finish_reasons`` (strings); otherwise a
    :class:`RolloutEngineError` (not an IndexError deep in :meth:`VLLMRolloutEngine.generate`)."""
    tokens, lps, finish = out.get("token_ids"), out.get("logprobs"), out.get("finish_reasons")
    ok = (
        isinstance(tokens, list)
        and isinstance(lps, list)
        and isinstance(finish, list)
        and len(tokens) == len(lps) == len(finish) == rows
        and all(isinstance(f, str) for f in finish)
        and all(
            isinstance(t, list)
            and isinstance(lp, list)
            and len(t) == len(lp)
            and all(type(x) is int and x >= 0 for x in t)
            and all(type(x) in (int, float) for x in lp)
            for t, lp in zip(tokens, lps, strict=True)
        )
    )
    if not ok:
        raise RolloutEngineError(
            f"the vllm rollout engine at {url} answered /generate with other than {rows} rows of token_ids "
            f"(ids >= 0), logprobs (one number per token) and finish_reasons (strings): {str(out)[:300]}"
        )
    return out


def _on_leader(work: Callable[[], T]) -> T:
    """``work()`` run on rank 0, its result (or its error, as a :class:`RolloutEngineError` unless
    it is an :class:`EngineSetupError`) on every rank: the other ranks must not wait forever in
    the next collective for a rank 0 that failed."""
    if not dp.is_distributed():
        return work()
    outcome: tuple[bool, Any] = (True, None)
    if dp.is_leader():
        try:
            outcome = (True, work())
        except (RolloutEngineError, EngineSetupError) as e:
            outcome = (False, e)
        except Exception as e:  # an OSError of /dev/shm, a store's RuntimeError, ...
            # reaches every rank as an engine error: the others must not wait in the next collective
            failed = RolloutEngineError(
                f"the vllm rollout engine's side of this run failed: {type(e).__name__}: {e}"
            )
            failed.__cause__ = e
            outcome = (False, failed)
    ok, value = dp.broadcast_object(outcome)
    if not ok:
        raise value
    return cast(T, value)


def _global_mismatch(
    engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """:func:`~openaligner.algorithms.logprob_mismatch` over every rank's rows (the same on all)."""
    keep = mask.bool()
    d = (engine_logprobs.double() - trainer_logprobs.double()).abs()[keep]
    sums = dp.all_reduce_sum(torch.stack([d.sum(), d.exp().sum(), torch.tensor(float(d.numel()))]).double())
    top = dp.all_reduce_max(d.max() if d.numel() else torch.zeros((), dtype=torch.float64))
    n = float(sums[2])
    if n == 0:
        return {"logprob_diff_mean": 0.0, "logprob_diff_max": 0.0, "token_prob_error": 1.0}
    return {
        "logprob_diff_mean": float(sums[0]) / n,
        "logprob_diff_max": float(top),
        "token_prob_error": float(sums[1]) / n,
    }


def _plain_config(actor: CausalLMActor) -> Any:
    """The Hugging Face config of the policy as a plain causal LM (LoRA and sharding wrappers
    looked through), with ``architectures`` set: vLLM picks its model class by it."""
    from openaligner.models.lora import is_peft_model

    model: Any = actor.model
    base = model.get_base_model() if is_peft_model(model) else model
    config = copy.deepcopy(base.config)
    if not getattr(config, "architectures", None):
        name = type(base).__name__
        config.architectures = [name.removeprefix("FSDP")]  # FSDP2 renames the class it shards
    return config


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to ``proc``'s process group (it leads its own session), then SIGKILL if it is
    still there after ``grace_s``; reaps ``proc``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; anything it spawned into its group goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        break
    if proc.poll() is None:
        proc.wait(timeout=10.0)
