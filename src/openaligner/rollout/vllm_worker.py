"""The vLLM rollout engine's own process: a ``vllm.LLM`` behind a small JSON-over-HTTP server,
run by the rollout environment's Python (``rollout.vllm.python``), never imported by the project.

Owns the endpoints (``/health``, ``/info``, ``/generate``, ``/reload_weights``, ``/collective/*``;
standalone, for ``openaligner serve-rollout``: the one-trainer lease and weight uploads), read on a
thread per connection and served one at a time; a malformed request gets a 4xx JSON error naming
the field. Must not import anything but the standard library, vLLM and the torch vLLM brings (it
runs in a virtualenv without the project: ``python -I``).
Design notes (the wire format): docs/rollout-engine.md, "Module notes".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import struct
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from typing import Any, TypeGuard, cast


class BadRequest(ValueError):
    """A request the engine cannot serve; the message names the field and what was expected."""

    code = 400


class Conflict(BadRequest):
    """A request of a trainer that does not hold this engine (standalone: one trainer at a time)."""

    code = 409


class TooLarge(BadRequest):
    """A body larger than the engine takes (an upload that does not fit, a JSON body over
    :data:`MAX_JSON_BYTES`)."""

    code = 413


class CollectiveFailed(BadRequest):
    """A collective weight push that failed between the two sides (the group could not be built,
    or a broadcast did not complete): the trainer's to retry after a new init."""

    code = 502


class LengthRequired(BadRequest):
    """A body without a ``Content-Length`` (chunked): the engine reads bodies of a known size only."""

    code = 411


class BodyTimeout(BadRequest):
    """A body that stopped arriving before its ``Content-Length`` bytes (the client stalled)."""

    code = 408


LEASE_HEADER = "X-Openaligner-Lease"
"""The header carrying a standalone engine's lease (from ``POST /attach``) on every later request."""

WEIGHTS_FILE = "model.safetensors"
"""The file a push writes (a local trainer) or uploads (``PUT /weights``) into the weights directory."""

MODEL_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "tie_word_embeddings",
)
"""The fields of the served model's ``config.json`` that ``GET /info`` reports: a trainer whose
actor differs in any of them must not push its weights here."""


MAX_JSON_BYTES = 1 << 28
"""The largest JSON body the engine reads (256 MiB: a /generate of thousands of long prompts is
far smaller); a larger ``Content-Length`` is answered 413 before a byte of it is read."""

MAX_SAFETENSORS_HEADER = 100_000_000
"""The largest safetensors header an upload may carry (the safetensors library's own limit)."""

SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
"""Bytes per element of the safetensors dtypes an upload may hold."""

GENERATE_FIELDS = (
    "prompts", "seeds", "greedy", "temperature", "top_k", "top_p",
    "max_tokens", "min_tokens", "stop_token_ids",
)  # fmt: skip
"""The fields of a ``POST /generate`` body; any other is refused (a misspelt setting would be ignored)."""

INT_LIMIT = 1 << 31  # token counts, top_k and token ids beyond this are no model's

COLLECTIVE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool")
"""The tensor dtypes a collective push may carry (by torch's names)."""

COLLECTIVE_ALIGN = 16
"""Byte alignment of every tensor in a bucket (any dtype may be viewed at such an offset)."""

COLLECTIVE_BUCKET_BYTES = 256 << 20
"""The trainer's bucket size: each broadcast carries at most this many bytes (a larger tensor
goes alone), so neither side needs a second copy of the whole model to send or receive."""


def bucket_layout(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """How a collective push packs tensors of ``sizes`` bytes (in order) into byte buffers, each
    broadcast once: per bucket, ``(tensor index, byte offset, bytes)``; offsets are aligned to
    :data:`COLLECTIVE_ALIGN`, a bucket holds at most ``bucket_bytes`` unless one tensor alone is
    larger. The trainer and the engine compute it alike from the same list."""
    buckets: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    end = 0
    for i, n in enumerate(sizes):
        offset = -(-end // COLLECTIVE_ALIGN) * COLLECTIVE_ALIGN
        if current and offset + n > bucket_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append((i, offset, n))
        end = offset + n
    if current:
        buckets.append(current)
    return buckets


def bucket_bytes_of(bucket: list[tuple[int, int, int]]) -> int:
    """The byte length of one bucket of :func:`bucket_layout`."""
    _, offset, n = bucket[-1]
    return offset + n


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any, name: str, low: int = 0, high: int = INT_LIMIT) -> list[int]:
    """``value`` as a list of integers in ``[low, high)``, or a 400 naming ``name``."""
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise BadRequest(f"{name} must be a list of integers, got {_short(value)}")
    bad = [v for v in value if not low <= v < high]
    if bad:
        raise BadRequest(f"{name} must hold integers in [{low}, {high}), got {_short(bad[0])}")
    return value


def _number(body: dict[str, Any], name: str, kind: type, low: float, high: float) -> Any:
    """``body[name]`` as a finite ``kind`` in ``[low, high]``, or a 400 naming ``name``."""
    value: Any = body.get(name)
    if kind is float and _is_int(value):
        value = float(value)
    if type(value) is not kind:  # True is no int here
        raise BadRequest(f"{name} must be a finite {kind.__name__}, got {_short(value)}")
    number = cast(float, value)
    if not math.isfinite(number):
        raise BadRequest(f"{name} must be a finite {kind.__name__}, got {_short(value)}")
    if not low <= number <= high:
        raise BadRequest(f"{name} must lie in [{low:g}, {high:g}], got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_a_number(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"{text} is too large for a float (JSON has no Infinity)")
    return value


def parse_json(data: bytes) -> Any:
    """A request body as JSON: UTF-8, no NaN/Infinity, nesting as deep as Python parses; anything
    else is a :class:`BadRequest` naming what was wrong."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_not_a_number, parse_float=_finite)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8 JSON ({e})") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    except RecursionError:
        raise BadRequest("the body is not JSON this engine reads (nested too deep)") from None


class Engine:
    """The ``vllm.LLM`` and the two operations the trainer needs."""

    def __init__(self, args: argparse.Namespace, llm: Any = None) -> None:
        """``llm``: an engine built elsewhere (tests); None builds ``vllm.LLM`` from ``args``."""
        kwargs: dict[str, Any] = {
            "model": args.model,
            "skip_tokenizer_init": True,  # token ids in and out: the trainer owns the tokenizer
            "generation_config": "vllm",  # the model's generation_config.json must not change defaults
            "dtype": args.dtype,
            "enforce_eager": args.enforce_eager,
            "logprobs_mode": "processed_logprobs",  # after temperature/top-k/top-p, as sampled
            "tensor_parallel_size": args.tensor_parallel_size,
            "seed": 0,
        }
        if args.max_model_len:
            kwargs["max_model_len"] = args.max_model_len
        if args.gpu_memory_utilization:
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.tensor_parallel_size == 1:
            kwargs["distributed_executor_backend"] = "uni"  # one process: killed as one
        self.workdir = os.path.realpath(args.workdir) if args.workdir else None
        self.standalone = args.standalone
        self.lease_ttl_s = args.lease_ttl_s
        self.request_timeout_s = float(getattr(args, "request_timeout_s", 300.0))
        # requests are read concurrently (a stalled client must not hold the others); the engine
        # itself (vllm.LLM is not thread-safe, the lease, the weights file) serves one at a time
        self.lock = threading.Lock()
        self.lease: str | None = None  # standalone: the attached trainer's lease
        self.holder = ""  # and who it is (for the message refusing a second one)
        self.last_seen = 0.0  # when the holder last sent a request (monotonic)
        self.dtype = args.dtype
        self.model = _model_summary(args.model)
        self.local_token = ""
        # POST /collective/init: (process group, device, store) of the trainer's weight broadcasts
        self.collective: tuple[Any, Any, Any] | None = None
        # one engine process: received buckets stream into vLLM's reload (no generator crosses
        # to tensor-parallel workers, whose arguments are pickled)
        self.streams_weights = args.tensor_parallel_size == 1
        self.incomplete = False  # a streamed push failed midway: the weights are part old, part new
        # POST /collective/plan: the next receive's push id, tensors (name, dtype, shape, bytes)
        # and their bucket_layout
        self.plan: (
            tuple[str, list[tuple[str, Any, list[int], int]], list[list[tuple[int, int, int]]]] | None
        ) = None
        if self.standalone:
            if self.workdir is None:
                raise SystemExit("--standalone needs --workdir (where pushed weights are kept)")
            os.makedirs(self.weights_dir, exist_ok=True)
            # a trainer that can read this file runs on this machine: it writes its weights into
            # weights_dir itself instead of uploading them (POST /attach compares the token)
            self.local_token = secrets.token_hex(16)
            token = os.path.join(self.workdir, "local-token")
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.local_token)
        if llm is None:
            from vllm import LLM

            llm = LLM(**kwargs)
        self.llm = llm
        self.max_model_len = _max_model_len(llm)

    @property
    def weights_dir(self) -> str:
        assert self.workdir is not None
        return os.path.join(self.workdir, "weights")

    # ------------------------------------------------------------------ standalone: the lease
    def info(self) -> dict[str, Any]:
        lease = None
        if self.lease is not None:
            lease = {"holder": self.holder, "idle_s": round(time.monotonic() - self.last_seen, 3)}
        return {
            "model": self.model,
            "dtype": self.dtype,
            "standalone": self.standalone,
            "workdir": self.workdir,
            "lease": lease,
            "lease_ttl_s": self.lease_ttl_s,
            "max_model_len": self.max_model_len,
            "collective_backend": _collective_backend(),
            "gpu_uuid": _gpu_uuid(),
        }

    def check_lease(self, lease: str | None) -> None:
        """Refuse a request of anyone but the attached trainer (standalone only); a request of the
        holder renews its lease."""
        if not self.standalone:
            return
        given = (lease or "").encode("utf-8", "replace")
        if self.lease is None or not secrets.compare_digest(given, self.lease.encode()):
            held = f"it is attached to {self.holder}" if self.lease is not None else "no trainer is attached"
            raise Conflict(
                f"the {LEASE_HEADER} header must carry the lease from POST /attach ({held}; a lease "
                f"is lost after {self.lease_ttl_s:g} s without a request, when another trainer may take it)"
            )
        self.last_seen = time.monotonic()

    def attach(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.standalone:
            raise BadRequest("POST /attach is for a standalone engine (openaligner serve-rollout)")
        client = body.get("client")
        if not isinstance(client, str) or not client:
            raise BadRequest("client must be a non-empty string naming the trainer (e.g. host:pid)")
        token = body.get("local_token")
        if token is not None and not isinstance(token, str):
            raise BadRequest("local_token must be a string or null")
        idle = time.monotonic() - self.last_seen
        if self.lease is not None and idle < self.lease_ttl_s:
            raise Conflict(
                f"this engine is attached to another trainer ({self.holder}, last request {idle:.0f} s ago): "
                "two trainers would overwrite each other's weights; stop that run first, or start "
                f"another engine (its lease lapses {self.lease_ttl_s:g} s after its last request)"
            )
        if self.lease is not None:
            print(
                f"lease of {self.holder} lapsed ({idle:.0f} s without a request)", file=sys.stderr, flush=True
            )
        self.lease, self.holder, self.last_seen = secrets.token_hex(16), client, time.monotonic()
        local = token is not None and secrets.compare_digest(token, self.local_token)
        print(f"attached: {client} ({'same machine' if local else 'remote'})", flush=True)
        return {"lease": self.lease, "local": local, "weights_dir": self.weights_dir}

    def detach(self, body: dict[str, Any]) -> dict[str, Any]:
        print(f"detached: {self.holder}", flush=True)
        self.lease, self.holder = None, ""
        self._end_collective()  # the next trainer builds its own
        _remove_file(os.path.join(self.weights_dir, WEIGHTS_FILE))
        return {"ok": True}

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    def upload_weights(self, length: int | None, stream: Any, lease: str | None) -> dict[str, Any]:
        """``PUT /weights``: the body (``Content-Length`` bytes, a safetensors file) becomes
        ``weights_dir/model.safetensors`` once it has all arrived and its header describes exactly
        its bytes; a short, stalled or malformed body is refused and leaves nothing behind (the
        last whole upload stays). The body is received without the engine's lock, so a slow
        upload does not hold other requests; ``lease`` is checked before and again after it."""
        with self.lock:
            self.check_lease(lease)
        if not self.standalone:
            raise BadRequest("PUT /weights is for a standalone engine (openaligner serve-rollout)")
        if length is None or length <= 8:
            raise BadRequest("PUT /weights needs a Content-Length header: the size of a safetensors file")
        free = shutil.disk_usage(self.weights_dir).free
        if length > free:
            raise TooLarge(
                f"the weights ({length} bytes) do not fit in {self.weights_dir} ({free} bytes free)"
            )
        # a name of its own (not *.safetensors: never loaded half-written)
        fd, part = tempfile.mkstemp(suffix=".part", dir=self.weights_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                receive(stream, length, f.write, self.request_timeout_s)
            _check_safetensors(part, length)
            with self.lock:
                self.check_lease(lease)
                os.replace(part, os.path.join(self.weights_dir, WEIGHTS_FILE))
        finally:
            _remove_file(part)
        return {"bytes": length}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``: every field is checked (types, ranges, token ids inside the
        served model's vocabulary, one seed per prompt) before anything reaches vLLM."""
        from vllm import SamplingParams

        if self.incomplete:
            raise Conflict(
                "the last weight push failed midway and left the engine's weights part old, part new: "
                "push the weights again before generating"
            )
        unknown = sorted(set(body) - set(GENERATE_FIELDS))
        if unknown:
            raise BadRequest(
                f"unknown field(s) {', '.join(unknown)}; a /generate body has {', '.join(GENERATE_FIELDS)}"
            )
        size = self.model.get("vocab_size")
        vocab: int = size if _is_int(size) and size > 0 else INT_LIMIT
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise BadRequest(f"prompts must be a non-empty list of token-id lists, got {_short(prompts)}")
        prompts = [_int_list(p, f"prompts[{i}]", high=vocab) for i, p in enumerate(prompts)]
        if any(not p for p in prompts):
            raise BadRequest("prompts[i] must hold at least one token id")
        seeds = _int_list(body.get("seeds"), "seeds", high=1 << 63)
        if len(seeds) != len(prompts):
            raise BadRequest(f"seeds must hold one seed per prompt ({len(prompts)}), got {len(seeds)}")
        greedy = body.get("greedy")
        if not isinstance(greedy, bool):
            raise BadRequest(f"greedy must be true or false, got {_short(greedy)}")
        # checked even when greedy ignores them: a bad value is the trainer's bug either way
        temperature = _number(body, "temperature", float, 0.0, math.inf)
        top_k = _number(body, "top_k", int, -1, INT_LIMIT - 1)  # -1 and 0: no top-k
        top_p = _number(body, "top_p", float, 0.0, 1.0)
        if top_p == 0.0:
            raise BadRequest("top_p must lie in (0, 1], got 0.0")
        max_tokens = _number(body, "max_tokens", int, 1, INT_LIMIT - 1)
        min_tokens = _number(body, "min_tokens", int, 0, max_tokens)
        if self.max_model_len is not None:
            # vLLM refuses only a prompt that fills the window (a ValueError, once a 500); a prompt
            # that leaves less room than max_tokens would end at the window unfinished, and a
            # trainer that gates unfinished responses would learn nothing from it: refused whole
            for i, p in enumerate(prompts):
                if len(p) + max_tokens > self.max_model_len:
                    raise BadRequest(
                        f"prompts[{i}] has {len(p)} tokens: with max_tokens={max_tokens} that is "
                        f"{len(p) + max_tokens}, over the engine's max_model_len={self.max_model_len}; "
                        "start the engine with a larger max_model_len (rollout.vllm.max_model_len, or "
                        "serve-rollout's vllm.max_model_len; 0 = the model's own limit) or shorten the "
                        "prompts or the responses (data.seq_length, trainer.length.max_length)"
                    )
        common = {
            "temperature": 0.0 if greedy else temperature,
            "top_k": 0 if greedy else top_k,
            "top_p": 1.0 if greedy else top_p,
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "stop_token_ids": _int_list(body.get("stop_token_ids"), "stop_token_ids", high=vocab),
            # only the trainer's stop ids end a response (they include its tokenizer's EOS);
            # min_tokens then bans exactly those
            "ignore_eos": True,
            "logprobs": 0,  # the sampled token's own log-prob
            "detokenize": False,
        }
        try:
            params = [SamplingParams(seed=s, **common) for s in seeds]
        except (ValueError, TypeError) as e:
            raise BadRequest(f"sampling settings refused by vLLM: {e}") from None
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
        )
        token_ids, logprobs, finish = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            token_ids.append(ids)
            row = completion.logprobs or []
            logprobs.append([float(step[t].logprob) for step, t in zip(row, ids, strict=True)])
            finish.append(str(completion.finish_reason))
        return {"token_ids": token_ids, "logprobs": logprobs, "finish_reasons": finish}

    # ------------------------------------------------------------------ collective weight pushes
    def collective_init(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /collective/init {"host", "port", "timeout_s"}``: join the trainer's two-member
        process group (its TCP store at host:port; the trainer is rank 0, this engine rank 1) over
        which :meth:`collective_receive` takes weights: gloo on CPU, NCCL on a GPU. Sets the store
        key ``joining`` once connected (the trainer builds its end only then: a refusal before it
        leaves nothing of the trainer's waiting), and answers once the group is up; replaces any
        earlier group."""
        import datetime

        import torch
        import torch.distributed as tdist

        host, port = body.get("host"), body.get("port")
        if not isinstance(host, str) or not host:
            raise BadRequest(
                f"host must name the trainer's store (a host name or address), got {_short(host)}"
            )
        if not _is_int(port) or not 0 < port < 65536:
            raise BadRequest(f"port must be the trainer's store port in [1, 65535], got {_short(port)}")
        timeout_s = _number(body, "timeout_s", float, 1.0, 86400.0)
        self._end_collective()
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = _collective_backend()
        group: Any
        try:
            # a short connect: an address this engine cannot reach must not hold it (and its lock)
            store = tdist.TCPStore(host, port, 2, False, datetime.timedelta(seconds=min(timeout_s, 30.0)))
            store.set_timeout(timeout)
            store.set("joining", "1")
            prefixed = tdist.PrefixStore("openaligner-weights", store)
            if backend == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
                options = tdist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = tdist.ProcessGroupNCCL(prefixed, 1, 2, options)
            else:
                device = torch.device("cpu")
                group = tdist.ProcessGroupGloo(prefixed, 1, 2, timeout)
        except (RuntimeError, ValueError, OSError) as e:
            raise CollectiveFailed(f"could not join the trainer's group at {host}:{port}: {e}") from None
        self.collective = (group, device, store)
        print(f"collective weight pushes: joined {host}:{port} ({backend})", flush=True)
        return {"backend": backend}

    def _end_collective(self) -> None:
        """Drop the group (and a plan for it); NCCL's is shut down (its communicator aborted)."""
        if self.collective is not None:
            shutdown = getattr(self.collective[0], "shutdown", None)
            if callable(shutdown):
                with contextlib.suppress(Exception):
                    shutdown()
        self.collective = self.plan = None

    def collective_plan(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /collective/plan {"push": id, "tensors": [[name, dtype, shape], ...],
        "bucket_bytes": N}``: what the next :meth:`collective_receive` takes, checked here, before
        any broadcast starts."""
        import torch

        if self.collective is None:
            raise Conflict("no collective group: POST /collective/init first (after an error, again)")
        self.plan = None
        push = body.get("push")
        if not isinstance(push, str) or not push or len(push) > 64:
            raise BadRequest(f"push must be a string of 1-64 characters naming this push, got {_short(push)}")
        tensors = body.get("tensors")
        if not isinstance(tensors, list) or not tensors:
            raise BadRequest(
                f"tensors must be a non-empty list of [name, dtype, shape], got {_short(tensors)}"
            )
        specs: list[tuple[str, Any, list[int], int]] = []
        for i, t in enumerate(tensors):
            ok = isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and bool(t[0])
            if not ok or t[1] not in COLLECTIVE_DTYPES or not isinstance(t[2], list):
                raise BadRequest(
                    f"tensors[{i}] must be [name, dtype, shape] with dtype one of "
                    f"{', '.join(COLLECTIVE_DTYPES)} and shape a list, got {_short(t)}"
                )
            shape = _int_list(t[2], f"tensors[{i}] shape", high=INT_LIMIT) if t[2] else []
            dtype = getattr(torch, t[1])
            specs.append((t[0], dtype, shape, math.prod(shape) * torch.empty((), dtype=dtype).element_size()))
        bucket_bytes = _number(body, "bucket_bytes", int, 1, 1 << 40)
        total = sum(n for *_, n in specs)
        layout = bucket_layout([n for *_, n in specs], bucket_bytes)
        # streamed: one bucket at a time; else every bucket is held until the reload
        needed = max(bucket_bytes_of(b) for b in layout) if self.streams_weights else total
        free = _free_bytes(self.collective[1])
        if needed > free:
            raise TooLarge(
                f"receiving the weights ({total} bytes) needs {needed} bytes, over the engine's free memory "
                f"({free} bytes)"
            )
        self.plan = (push, specs, layout)
        return {"bytes": total, "buckets": len(layout)}

    def collective_receive(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /collective/receive {}``: receive the planned tensors from the trainer's
        broadcasts (packed as :func:`bucket_layout` says, one broadcast per bucket) and reload
        the model from them, then drop the prefix cache. Sets the store key ``ready/<push>``
        first: the trainer broadcasts only after it (a refusal here leaves it waiting on nothing).
        With one engine process (tensor parallel 1) the buckets are streamed into vLLM's reload
        as they arrive (one bucket in memory, not a second copy of the model); with more, they
        are received whole first (vLLM sends them on to its workers). A failure (the trainer
        gone, a timeout) ends the group (init again); mid-stream it also leaves the weights
        incomplete, and ``/generate`` is refused until a push succeeds."""
        import torch
        import torch.distributed as tdist

        if self.collective is None or self.plan is None:
            raise Conflict("no planned push: POST /collective/init (once) and /collective/plan first")
        (group, device, store), (push, specs, layout) = self.collective, self.plan
        self.plan = None  # a plan is used once
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0

        def arriving() -> Any:
            for bucket in layout:
                buf = torch.empty(bucket_bytes_of(bucket), dtype=torch.uint8, device=device)
                group.broadcast([buf], opts).wait()
                for index, offset, n in bucket:
                    name, dtype, shape, _ = specs[index]
                    yield name, buf[offset : offset + n].view(dtype).view(shape)

        t0 = time.perf_counter()
        try:
            store.set(f"ready/{push}", "1")
            if self.streams_weights:
                self.incomplete = True  # until vLLM has taken the last tensor
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": arriving()})
            else:
                weights = list(arriving())
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except Exception as e:  # the trainer gone, a timeout, out of memory (inside vLLM's reload too)
            self._end_collective()
            raise CollectiveFailed(
                f"the weights did not arrive ({type(e).__name__}: {e}); POST /collective/init again"
            ) from None
        self.incomplete = False
        self.llm.reset_prefix_cache()  # as after a reload from a file
        return {"bytes": sum(n for *_, n in specs), "seconds": time.perf_counter() - t0}

    def reload_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("path", self.weights_dir if self.standalone else None)
        if not isinstance(path, str) or not os.path.isdir(path):
            raise BadRequest(f"path must name a directory of .safetensors files, got {path!r}")
        if self.workdir is not None:
            if os.path.commonpath([os.path.realpath(path), self.workdir]) != self.workdir:
                # the engine loads only what was written into its own directory, never any file named to it
                raise BadRequest(f"path must lie in the engine's directory {self.workdir}, got {path!r}")
            path = os.path.realpath(path)  # what was checked is what is loaded
        if not any(name.endswith(".safetensors") for name in os.listdir(path)):
            raise BadRequest(f"{path} holds no .safetensors file: write or PUT /weights first")
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.incomplete = False
        # cached KV blocks were computed by the old weights: without a reset, prompts sharing a
        # prefix with earlier ones would continue from stale keys and values
        self.llm.reset_prefix_cache()
        if self.standalone:  # loaded: a second copy of the model in shared memory would be waste
            _remove_file(os.path.join(path, WEIGHTS_FILE))
        return {"seconds": time.perf_counter() - t0}


def _collective_backend() -> str:
    """The process group a collective push uses here: NCCL where this engine has a GPU, else gloo."""
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:  # only tests run the server without torch
        return "gloo"


def _gpu_uuid() -> str | None:
    """The UUID of this engine's (first) GPU, None without one: a trainer on the same GPU cannot
    form an NCCL group with it (NCCL refuses two ranks on one device)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except ImportError:  # only tests run the server without torch
        return None


def _free_bytes(device: Any) -> int:
    """Memory free for received weights: the GPU's free memory, or the machine's available RAM."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def _max_model_len(llm: Any) -> int | None:
    """The longest prompt + response ``llm`` serves (vLLM's resolved ``max_model_len``: the
    flag, else the model's own limit); None when the engine does not say."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    value = getattr(config, "max_model_len", None)
    return value if _is_int(value) and value > 0 else None


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def receive(stream: Any, length: int, sink: Any, timeout_s: float) -> None:
    """Pass exactly ``length`` bytes of ``stream`` to ``sink``; a body that ends early or stalls
    (the socket's timeout) is a :class:`BadRequest` (408 for a stall) naming how much came."""
    received = 0
    try:
        while received < length:
            chunk = stream.read(min(1 << 20, length - received))
            if not chunk:
                break
            sink(chunk)
            received += len(chunk)
    except TimeoutError:
        raise BodyTimeout(
            f"the body stopped arriving after {received} of {length} bytes "
            f"(nothing for {timeout_s:g} s; --request-timeout-s)"
        ) from None
    except OSError as e:  # the client went away mid-body
        raise BadRequest(f"the body ended after {received} of {length} bytes ({e})") from None
    if received != length:
        raise BadRequest(f"the body ended after {received} of {length} bytes")


def _check_safetensors(path: str, size: int) -> None:
    """Refuse a file that is not a safetensors file whose tensors fill exactly its ``size`` bytes:
    each tensor's bytes match its dtype and shape, and they tile the data with no gap or overlap
    (what vLLM would otherwise find out while loading it, if at all)."""

    def refuse(why: str) -> BadRequest:
        return BadRequest(f"not a safetensors file of {size} bytes ({why})")

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise refuse(f"its header length {n} exceeds the file or {MAX_SAFETENSORS_HEADER} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise refuse("its header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise refuse(f"tensor {_short(name)} is not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise refuse(
                f"tensor {_short(name)} has dtype {_short(dtype)}, "
                f"not one of {', '.join(SAFETENSORS_DTYPE_BYTES)}"
            )
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise refuse(f"tensor {_short(name)} has shape {_short(shape)}, not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise refuse(f"tensor {_short(name)} has data_offsets {_short(offsets)}, not [begin, end]")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]:
            raise refuse(
                f"tensor {_short(name)}: data_offsets {offsets} do not hold {dtype} of shape {shape}"
            )
        spans.append((offsets[0], offsets[1], name))
    if not spans:
        raise refuse("its header describes no tensor")
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise refuse(f"tensor {_short(name)} begins at {begin}, not where the one before ends ({end})")
        end = stop
    if end != size - 8 - n:
        raise refuse(f"its header describes other data than was sent: {end} bytes, not {size - 8 - n}")


def _model_summary(model_dir: str) -> dict[str, Any]:
    """The :data:`MODEL_KEYS` of ``model_dir/config.json`` that it sets."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return {k: config.get(k, text.get(k)) for k in MODEL_KEYS if k in config or k in text}


def make_handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    # path -> (operation, needs the lease of a standalone engine)
    routes: dict[str, tuple[Any, bool]] = {
        "/generate": (engine.generate, True),
        "/reload_weights": (engine.reload_weights, True),
        "/attach": (engine.attach, False),
        "/heartbeat": (engine.heartbeat, True),
        "/detach": (engine.detach, True),
        "/collective/init": (engine.collective_init, True),
        "/collective/plan": (engine.collective_plan, True),
        "/collective/receive": (engine.collective_receive, True),
    }

    methods = "GET /health or /info, POST " + ", ".join(routes) + ", PUT /weights"

    class Handler(BaseHTTPRequestHandler):
        # a client that stops sending is dropped (408) after this long; the others are served meanwhile
        timeout = engine.request_timeout_s

        def _reply(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client is gone: nothing to answer
                self.close_connection = True

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (an unknown method, a malformed request line or
            header), as JSON like every other answer; an unknown method is the client's (405)."""
            self.close_connection = True
            if code == 501:
                code, message = 405, f"no {self.command} method here; {methods}"
            self._reply(code, {"error": f"{self.command} {self.path}: {message or explain}"})

        def _length(self, limit: int | None) -> int | None:
            if self.headers.get("Transfer-Encoding") is not None:
                raise LengthRequired(
                    f"Transfer-Encoding {self.headers['Transfer-Encoding']!r} is not read here: "
                    "send the body with a Content-Length header"
                )
            value = self.headers.get("Content-Length")
            if value is None:
                return None
            value = value.strip()
            if not (value.isascii() and value.isdigit()):
                raise BadRequest(f"Content-Length must be a byte count, got {value!r}")
            if limit is not None and int(value) > limit:
                raise TooLarge(f"Content-Length {value} exceeds the {limit} bytes a JSON body may have")
            return int(value)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"ok": True})
            elif self.path == "/info":
                with engine.lock:
                    info = engine.info()
                self._reply(200, info)
            else:
                self._reply(404, {"error": f"no GET {self.path}; GET /health or /info"})

        def do_PUT(self) -> None:
            if self.path != "/weights":
                self._reply(404, {"error": f"no PUT {self.path}; PUT /weights"})
                return
            lease = self.headers.get(LEASE_HEADER)
            self._serve(lambda: engine.upload_weights(self._length(None), self.rfile, lease))

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self._reply(404, {"error": f"no POST {self.path}; POST one of {', '.join(routes)}"})
                return
            operation, lease = route

            def call() -> dict[str, Any]:
                if lease:  # before reading: a client without the lease is not read at all
                    with engine.lock:
                        engine.check_lease(self.headers.get(LEASE_HEADER))
                data = bytearray()
                receive(self.rfile, self._length(MAX_JSON_BYTES) or 0, data.extend, engine.request_timeout_s)
                body = parse_json(bytes(data) or b"null")
                if not isinstance(body, dict):
                    raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
                with engine.lock:  # and again with the engine: the lease may have lapsed meanwhile
                    if lease:
                        engine.check_lease(self.headers.get(LEASE_HEADER))
                    return dict(operation(body))

            self._serve(call)

        def _serve(self, call: Any) -> None:
            try:
                self._reply(200, call())
            except BadRequest as e:
                self.close_connection = True  # the body may be partly unread
                self._reply(e.code, {"error": f"{self.command} {self.path}: {e}"})
            except Exception as e:  # the engine's own failure: answered, logged, and the server goes on
                print(f"{self.path} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._reply(500, {"error": f"{self.path}: {type(e).__name__}: {e}"})

        def log_message(self, format: str, *args: Any) -> None:
            return None  # one line per request would drown the engine's log

    return Handler


def make_server(engine: Engine, host: str, port: int) -> HTTPServer:
    """The engine's HTTP server on ``host:port`` (0: any free port), not yet serving: a thread per
    connection reads requests (a stalled client holds only its own), the engine serves them one
    at a time (:attr:`Engine.lock`)."""
    server = ThreadingHTTPServer((host, port), make_handler(engine))
    server.daemon_threads = True
    return server


def _exit_with_parent(parent: int, workdir: str | None) -> None:
    """End this process when the trainer that started it is gone (killed without a chance to
    stop the engine): an orphaned engine would hold its memory (and a GPU) for nothing. Its
    working directory (the weights in shared memory) goes with it."""
    while True:
        if os.getppid() != parent:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            os._exit(3)
        time.sleep(1.0)


def parser() -> argparse.ArgumentParser:
    """The engine's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", required=True, help="a Hugging Face model directory (config + weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (written to --ready-file)")
    p.add_argument("--ready-file", required=True, help='written as {"port": N} once the engine serves')
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0, help="0: vLLM's default")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument(
        "--workdir", default=None, help="removed when exiting for --parent-pid; reloads read only from it"
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="serve one attached trainer at a time (POST /attach), which may upload weights (PUT /weights)",
    )
    p.add_argument(
        "--lease-ttl-s", type=float, default=60.0, help="a lease lapses this long after its last request"
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=300.0,
        help="a client that sends nothing for this long mid-request is answered 408 and dropped",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.parent_pid:
        watch = threading.Thread(target=_exit_with_parent, args=(args.parent_pid, args.workdir), daemon=True)
        watch.start()
    engine = Engine(args)
    server = make_server(engine, args.host, args.port)
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"port": server.server_address[1], "pid": os.getpid()}, f)
    os.replace(tmp, args.ready_file)  # the trainer sees the whole file or none
    print(f"vllm rollout engine serving on {args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that re-import this file
    sys.exit(main())
