"""The vLLM rollout engine's own process: a ``vllm.LLM`` behind a small JSON-over-HTTP server,
run by the rollout environment's Python (``rollout.vllm.python``), never imported by the project.

Owns the endpoints (``/health``, ``/info``, ``/generate``, ``/reload_weights``; standalone, for
``openaligner serve-rollout``: the one-trainer lease and weight uploads), one request at a time; a
malformed one gets a 4xx naming the field. Must not import anything but the standard library and
vLLM (it runs in a virtualenv without the project: ``python -I``).
Design notes (the wire format): docs/rollout-engine.md, "Module notes".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class BadRequest(ValueError):
    """A request the engine cannot serve; the message names the field and what was expected."""

    code = 400


class Conflict(BadRequest):
    """A request of a trainer that does not hold this engine (standalone: one trainer at a time)."""

    code = 409


class TooLarge(BadRequest):
    """An upload that does not fit where the engine keeps pushed weights."""

    code = 413


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


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{name} must be a list of integers")
    return value


def _number(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a {kind.__name__}, got {value!r}")
    return value


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
        self.lease: str | None = None  # standalone: the attached trainer's lease
        self.holder = ""  # and who it is (for the message refusing a second one)
        self.last_seen = 0.0  # when the holder last sent a request (monotonic)
        self.dtype = args.dtype
        self.model = _model_summary(args.model)
        self.local_token = ""
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
        }

    def check_lease(self, lease: str | None) -> None:
        """Refuse a request of anyone but the attached trainer (standalone only); a request of the
        holder renews its lease."""
        if not self.standalone:
            return
        if self.lease is None or lease != self.lease:
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
        _remove_file(os.path.join(self.weights_dir, WEIGHTS_FILE))
        return {"ok": True}

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    def upload_weights(self, length: int | None, stream: Any) -> dict[str, Any]:
        """``PUT /weights``: the body (``Content-Length`` bytes, a safetensors file) becomes
        ``weights_dir/model.safetensors`` once it has all arrived and its header agrees with its
        size; a short or malformed body is refused and leaves nothing behind."""
        if not self.standalone:
            raise BadRequest("PUT /weights is for a standalone engine (openaligner serve-rollout)")
        if length is None or length <= 8:
            raise BadRequest("PUT /weights needs a Content-Length header: the size of a safetensors file")
        free = shutil.disk_usage(self.weights_dir).free
        if length > free:
            raise TooLarge(
                f"the weights ({length} bytes) do not fit in {self.weights_dir} ({free} bytes free)"
            )
        final = os.path.join(self.weights_dir, WEIGHTS_FILE)
        part = final + ".part"  # not *.safetensors: never loaded half-written
        received = 0
        try:
            with open(part, "wb") as f:
                while received < length:
                    chunk = stream.read(min(1 << 20, length - received))
                    if not chunk:
                        break
                    f.write(chunk)
                    received += len(chunk)
            if received != length:
                raise BadRequest(f"PUT /weights: the body ended after {received} of {length} bytes")
            _check_safetensors(part, length)
            os.replace(part, final)
        finally:
            _remove_file(part)
        return {"bytes": received}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise BadRequest("prompts must be a non-empty list of token-id lists")
        prompts = [_int_list(p, "prompts[i]") for p in prompts]
        if any(not p for p in prompts):
            raise BadRequest("prompts[i] must hold at least one token id")
        seeds = _int_list(body.get("seeds"), "seeds")
        if len(seeds) != len(prompts):
            raise BadRequest(f"seeds must hold one seed per prompt ({len(prompts)}), got {len(seeds)}")
        greedy = body.get("greedy")
        if not isinstance(greedy, bool):
            raise BadRequest("greedy must be true or false")
        common = {
            "temperature": 0.0 if greedy else _number(body, "temperature", float),
            "top_k": 0 if greedy else _number(body, "top_k", int),
            "top_p": 1.0 if greedy else _number(body, "top_p", float),
            "max_tokens": _number(body, "max_tokens", int),
            "min_tokens": _number(body, "min_tokens", int),
            "stop_token_ids": _int_list(body.get("stop_token_ids"), "stop_token_ids"),
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

    def reload_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("path", self.weights_dir if self.standalone else None)
        if not isinstance(path, str) or not os.path.isdir(path):
            raise BadRequest(f"path must name a directory of .safetensors files, got {path!r}")
        if (
            self.workdir is not None
            and os.path.commonpath([os.path.realpath(path), self.workdir]) != self.workdir
        ):
            # the engine loads only what was written into its own directory, never any file named to it
            raise BadRequest(f"path must lie in the engine's directory {self.workdir}, got {path!r}")
        if not any(name.endswith(".safetensors") for name in os.listdir(path)):
            raise BadRequest(f"{path} holds no .safetensors file: write or PUT /weights first")
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        # cached KV blocks were computed by the old weights: without a reset, prompts sharing a
        # prefix with earlier ones would continue from stale keys and values
        self.llm.reset_prefix_cache()
        if self.standalone:  # loaded: a second copy of the model in shared memory would be waste
            _remove_file(os.path.join(path, WEIGHTS_FILE))
        return {"seconds": time.perf_counter() - t0}


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _check_safetensors(path: str, size: int) -> None:
    """Refuse a file whose safetensors header does not describe exactly ``size`` bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise BadRequest(f"PUT /weights: not a safetensors file (a header of {n} bytes in {size})")
        try:
            header = json.loads(f.read(n))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise BadRequest("PUT /weights: not a safetensors file (its header is not valid)") from None
    if not ends or max(ends) != size - 8 - n:
        raise BadRequest(
            f"PUT /weights: the safetensors header describes other data than the {size} bytes sent"
        )


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
    }

    class Handler(BaseHTTPRequestHandler):
        timeout = 300  # a client that stops sending must not hold the (one-request-at-a-time) server

        def _reply(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _length(self) -> int | None:
            value = self.headers.get("Content-Length")
            if value is None:
                return None
            if not value.strip().isdigit():
                raise BadRequest(f"Content-Length must be a byte count, got {value!r}")
            return int(value)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"ok": True})
            elif self.path == "/info":
                self._reply(200, engine.info())
            else:
                self._reply(404, {"error": f"no GET {self.path}; GET /health or /info"})

        def do_PUT(self) -> None:
            if self.path != "/weights":
                self._reply(404, {"error": f"no PUT {self.path}; PUT /weights"})
                return
            self._serve(lambda: engine.upload_weights(self._length(), self.rfile), lease=True)

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self._reply(404, {"error": f"no POST {self.path}; POST one of {', '.join(routes)}"})
                return
            operation, lease = route

            def call() -> dict[str, Any]:
                body = json.loads(self.rfile.read(self._length() or 0) or b"null")
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                return dict(operation(body))

            self._serve(call, lease)

        def _serve(self, call: Any, lease: bool) -> None:
            try:
                if lease:
                    engine.check_lease(self.headers.get(LEASE_HEADER))
                self._reply(200, call())
            except BadRequest as e:
                self.close_connection = True  # the body may be partly unread
                self._reply(e.code, {"error": f"{self.command} {self.path}: {e}"})
            except json.JSONDecodeError as e:
                self._reply(400, {"error": f"{self.command} {self.path}: the body is not JSON ({e})"})
            except Exception as e:  # the engine's own failure: answered, logged, and the server goes on
                print(f"{self.path} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._reply(500, {"error": f"{self.path}: {type(e).__name__}: {e}"})

        def log_message(self, format: str, *args: Any) -> None:
            return None  # one line per request would drown the engine's log

    return Handler


def make_server(engine: Engine, host: str, port: int) -> HTTPServer:
    """The engine's HTTP server on ``host:port`` (0: any free port), not yet serving."""
    return HTTPServer((host, port), make_handler(engine))


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
