"""The vLLM rollout engine's own process: a ``vllm.LLM`` behind a small JSON-over-HTTP server on
loopback, run by the rollout environment's Python (``rollout.vllm.python``), never imported by the
project.

Owns the endpoints ``GET /health``, ``POST /generate`` and ``POST /reload_weights`` (one request
at a time; a malformed one gets a 400 naming the field). Must not import anything but the
standard library and vLLM (it runs in a virtualenv without the project: ``python -I``).
Design notes (the wire format): docs/rollout-engine.md, "Module notes".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class BadRequest(ValueError):
    """A request the engine cannot serve; the message names the field and what was expected."""


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

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

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
        self.llm = LLM(**kwargs)

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
        path = body.get("path")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise BadRequest(f"path must name a directory of .safetensors files, got {path!r}")
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        # cached KV blocks were computed by the old weights: without a reset, prompts sharing a
        # prefix with earlier ones would continue from stale keys and values
        self.llm.reset_prefix_cache()
        return {"seconds": time.perf_counter() - t0}


def make_handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    routes = {"/generate": engine.generate, "/reload_weights": engine.reload_weights}

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"error": f"no GET {self.path}; GET /health"})

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self._reply(404, {"error": f"no POST {self.path}; POST one of {', '.join(routes)}"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                self._reply(200, route(body))
            except (BadRequest, json.JSONDecodeError) as e:
                self._reply(400, {"error": f"{self.path}: {e}"})
            except Exception as e:  # the engine's own failure: answered, logged, and the server goes on
                print(f"{self.path} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._reply(500, {"error": f"{self.path}: {type(e).__name__}: {e}"})

        def log_message(self, format: str, *args: Any) -> None:
            return None  # one line per request would drown the engine's log

    return Handler


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


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--workdir", default=None, help="removed when exiting for --parent-pid")
    args = p.parse_args(argv)
    if args.parent_pid:
        watch = threading.Thread(target=_exit_with_parent, args=(args.parent_pid, args.workdir), daemon=True)
        watch.start()
    engine = Engine(args)
    server = HTTPServer((args.host, args.port), make_handler(engine))
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"port": server.server_address[1], "pid": os.getpid()}, f)
    os.replace(tmp, args.ready_file)  # the trainer sees the whole file or none
    print(f"vllm rollout engine serving on {args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that re-import this file
    sys.exit(main())
