"""Shared pieces of the reliability tests: tiny real servers, raw KServe v2 HTTP, state snapshots,
resident memory of a process tree.

Requests are built by hand (JSON or the binary extension) and posted with ``http.client`` so that
anything can be sent — wrong dtypes, lying shapes, garbage bodies — exactly as a foreign client
would, without any client library's own checks in the way.
"""

from __future__ import annotations

import copy
import http.client
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from procs import descendants

from openaligner.io.checkpoint import CheckpointManager
from openaligner.protocol import TOKEN_PARAMETER, ErrorEnvelope
from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
from openaligner.servers.reward import RewardModelServer, make_render_func, make_tokenize_func
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

TOKEN = "reliability-s3cret"
MAX_BATCH = 16  # rows per infer request
MAX_TRAIN_ROWS = 16  # rows per critic_train request
VOCAB = 100  # the tiny models' vocabulary (char tokenizer)
POSITIONS = 256  # the tiny models' position limit = the servers' max_sequence_length

DATATYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
}


def reward_server(tiny: Any, port: int, **overrides: Any) -> RewardModelServer:
    """The tiny reward model behind ``reward_model`` (not started): tokenizer (for ``sentences``
    and ``messages``), vocabulary and sequence limits as ``openaligner serve-reward`` sets them."""
    settings: dict[str, Any] = dict(
        infer_fn=tiny.reward_model().infer,
        tokenize_func=make_tokenize_func(tiny.tokenizer, max_length=POSITIONS),
        render_func=make_render_func(tiny.tokenizer),
        port=port,
        inference_micro_batch_size=[4],
        model_forward_micro_batch_size=4,
        max_queue_delay_microseconds=2000,
        vocab_size=VOCAB,
        max_sequence_length=POSITIONS,
        max_batch_size=MAX_BATCH,
        heartbeat_s=None,
    )
    return RewardModelServer(**{**settings, **overrides})


def critic_server(
    tiny: Any, port: int, checkpoints: Path | None, *, token: str | None = TOKEN, **cfg: Any
) -> CriticServerTrainer:
    """The tiny critic, combined with the tiny reward model (not started); max_sequence_length is
    left to its default (the model's position limit)."""
    critic = tiny.critic()
    settings: dict[str, Any] = dict(
        port=port,
        inference_micro_batch_size=[4],
        model_forward_micro_batch_size=4,
        max_batch_size=MAX_BATCH,
        max_train_rows=MAX_TRAIN_ROWS,
        token=token,
        heartbeat_s=None,
    )
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=4, micro_batch_size=2),
        critic,
        torch.optim.AdamW(critic.parameters(), lr=1e-3, weight_decay=0.0),
        checkpoints=CheckpointManager(checkpoints) if checkpoints is not None else None,
    )
    return CriticServerTrainer(
        CriticServerConfig(**{**settings, **cfg}),
        trainer,
        make_tokenize_func(tiny.tokenizer, max_length=POSITIONS),
        reward_model=tiny.reward_model(),
    )


# ---------------------------------------------------------------------------- request bodies
def tensor(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    """One input of a JSON request."""
    return {"name": name, "datatype": datatype, "shape": list(shape), "data": data}


def json_body(inputs: list[dict[str, Any]], parameters: dict[str, Any] | None = None) -> bytes:
    doc: dict[str, Any] = {"inputs": inputs}
    if parameters is not None:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def array_json(name: str, array: np.ndarray) -> dict[str, Any]:
    """``array`` as a JSON input (its own datatype and shape)."""
    if array.dtype.kind in "SO":
        data = [bytes(v).decode("utf-8") for v in array.reshape(-1)]
        return tensor(name, "BYTES", list(array.shape), data)
    return tensor(name, DATATYPES[array.dtype], list(array.shape), array.reshape(-1).tolist())


def binary_body(
    arrays: dict[str, np.ndarray],
    parameters: dict[str, Any] | None = None,
    *,
    sizes: dict[str, int] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A binary-extension request: the JSON header, then each array's raw bytes (BYTES elements as
    4-byte little-endian length + bytes); and the header that says where the JSON ends.
    ``sizes`` overrides the declared ``binary_data_size`` of some inputs (to lie about them)."""
    inputs, blobs = [], b""
    for name, array in arrays.items():
        if array.dtype.kind in "SO":
            raw = b"".join(struct.pack("<I", len(bytes(v))) + bytes(v) for v in array.reshape(-1))
            datatype = "BYTES"
        else:
            raw = np.ascontiguousarray(array).tobytes()
            datatype = DATATYPES[array.dtype]
        inputs.append(
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": (sizes or {}).get(name, len(raw))},
            }
        )
        blobs += raw
    doc: dict[str, Any] = {"inputs": inputs}
    if parameters is not None:
        doc["parameters"] = parameters
    header = json.dumps(doc).encode()
    return header + blobs, {"Inference-Header-Content-Length": str(len(header))}


def with_token(parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {TOKEN_PARAMETER: TOKEN, **(parameters or {})}


# ---------------------------------------------------------------------------- HTTP
@dataclass(frozen=True)
class Answer:
    """One HTTP answer."""

    status: int
    body: bytes

    @property
    def error(self) -> str:
        """The error text: the server's own refusal when the answer carries one (PyTriton wraps it in
        a traceback), else the text of Triton's or the HTTP front's ``{"error": ...}``."""
        try:
            text = str(json.loads(self.body)["error"])
        except (ValueError, KeyError, TypeError):
            text = self.body.decode("utf-8", "replace")
        envelope = ErrorEnvelope.find(text)
        return envelope.message if envelope is not None else text

    def outputs(self) -> dict[str, np.ndarray]:
        """The outputs of a successful JSON answer."""
        assert self.status == 200, (self.status, self.error)
        doc = json.loads(self.body)
        return {o["name"]: np.array(o["data"], dtype=np.float64).reshape(o["shape"]) for o in doc["outputs"]}


def post(
    port: int,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = 60.0,
) -> Answer:
    """POST ``body`` to ``127.0.0.1:port``; ``Content-Type`` defaults to application/json."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return Answer(response.status, response.read())
    finally:
        conn.close()


def infer_path(model: str) -> str:
    return f"/v2/models/{model}/infer"


def valid_infer_body() -> bytes:
    """Two rows of tokens (one padded) for reward_model / critic_infer."""
    tokens = np.array([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]], np.int64)
    lengths = np.array([[5], [3]], np.int64)
    return json_body([array_json("tokens", tokens), array_json("sequence_lengths", lengths)])


# ---------------------------------------------------------------------------- state
def snapshot(server: CriticServerTrainer) -> dict[str, Any]:
    """Everything a training request could change: weights, optimizer state, step."""
    with server.lock:
        return {
            "weights": {k: v.detach().clone() for k, v in server.model.state_dict().items()},
            "optimizer": copy.deepcopy(server.trainer.optimizer.state_dict()),
            "step": server.step,
        }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-identical weights, optimizer state and step."""
    if a["step"] != b["step"] or a["weights"].keys() != b["weights"].keys():
        return False
    if not all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]):
        return False
    return _same_tree(a["optimizer"], b["optimizer"])


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def vm_rss_kb(pid: int) -> int:
    """Resident set size of ``pid`` in kB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Memory:
    """RSS of a server process alone and with its process tree, in kB."""

    server_kb: int
    tree_kb: int

    @classmethod
    def of(cls, pid: int) -> Memory:
        server = vm_rss_kb(pid)
        return cls(server, server + sum(vm_rss_kb(child) for child in descendants(pid)))


def files_under(root: Path) -> set[Path]:
    """Every file below ``root``."""
    return {p for p in root.rglob("*") if p.is_file()}
