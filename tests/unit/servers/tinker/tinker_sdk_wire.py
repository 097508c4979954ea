"""Run by the wire tests in the tinker SDK's own virtualenv (not the servers'): the SDK's side of
the bytes. Usage: ``python tinker_sdk_wire.py DIR``.

1. Writes ``DIR/requests/<case>.bin``: ForwardBackwardRequest bodies built from tinker types by
   the SDK's request conversion (tinker.proto.request_conv), as resources/training.py sends
   them (forward_only set on the message, zstd when client/config asks), and
   ``DIR/requests/<case>.json``: what the SDK meant (its own dense view of every tensor).
2. Parses every ``DIR/responses/<case>.bin`` (written by our encoder) with the SDK's
   response_conv and writes ``DIR/responses/<case>.json``: what the SDK read, plus the SDK
   pb2's own deterministic re-serialization of the bytes (hex).
3. Writes ``DIR/schema.json``: the SDK proto's fields, to compare with our schema.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import zstandard
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb


def dense(td: types.TensorData) -> dict:
    return {"dtype": td.dtype, "shape": list(td.to_torch().shape), "data": td.to_torch().flatten().tolist()}


def request_cases() -> dict[str, tuple[types.ForwardBackwardRequest, dict]]:
    g = torch.Generator().manual_seed(0)
    long_tokens = torch.randint(0, 50_000, (1000,), generator=g)
    rl = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7, 2**31 - 1])]
        ),
        loss_fn_inputs={
            "target_tokens": np.array([6, 7, 2**31 - 1, 3], dtype=np.int64),
            "logprobs": np.array([0.0, -1.5, -0.25, -3.0], dtype=np.float32),
            "advantages": torch.tensor([0.0, 1.0, 1.0, -2.5]),
        },
    )
    big = types.Datum(
        model_input=types.ModelInput.from_ints(long_tokens.tolist()),
        loss_fn_inputs={
            "target_tokens": torch.roll(long_tokens, -1),
            "weights": [1.0] * 1000,
        },
    )
    topk_targets = torch.zeros(6, 5, dtype=torch.int64)
    topk_targets[1, 0], topk_targets[4, 2] = 11, 42
    topk_weights = torch.zeros(6, 5)
    topk_weights[1, 0], topk_weights[4, 2] = 0.75, 1.0
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
        loss_fn_inputs={"target_tokens": topk_targets, "weights": topk_weights},  # 2-D torch: CSR
    )
    assert sparse.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    image = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1]), types.ImageChunk(data=b"\x89PNG", format="png")]
        ),
        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
    )
    spans = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]},
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s0", length=3)],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s1", offset=1, length=3)],
    )

    def req(data, loss_fn, config=None, model_id="sess-1:train:0", seq_id=1):
        return types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=data, loss_fn=loss_fn, loss_fn_config=config
            ),
            model_id=model_id,
            seq_id=seq_id,
        )

    return {
        "rl_ppo": (req([rl], "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}, seq_id=7), {}),
        "ce_two_datums": (req([big, rl], "cross_entropy"), {}),
        "ce_sparse_topk": (req([sparse], "cross_entropy", model_id="m"), {}),
        "dro_text_config": (req([rl], "dro", {"beta": 0.05, "variant": "soft"}), {}),
        "forward_only": (req([rl], "importance_sampling", seq_id=2**31 - 1), {"forward_only": True}),
        "no_data": (req([], "cross_entropy", seq_id=None), {}),
        "provenance": (req([spans], "cross_entropy"), {}),
        "image_chunk": (req([rl, image], "cross_entropy"), {}),
        "zstd": (req([rl], "importance_sampling"), {"zstd": True}),
    }


def write_requests(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (request, how) in request_cases().items():
        msg = request_conv.forward_backward_request_to_proto(request)
        msg.forward_only = how.get("forward_only", False)
        body = msg.SerializeToString()
        if how.get("zstd"):
            body = zstandard.ZstdCompressor().compress(body)
        (out / f"{name}.bin").write_bytes(body)
        fbi = request.forward_backward_input
        expected = {
            "model_id": request.model_id,
            "seq_id": request.seq_id if request.seq_id is not None else 0,
            "loss_fn": fbi.loss_fn,
            "loss_fn_config": dict(fbi.loss_fn_config or {}),
            "forward_only": how.get("forward_only", False),
            "datums": [
                {
                    "tokens": [
                        t
                        for c in d.model_input.chunks
                        if isinstance(c, types.EncodedTextChunk)
                        for t in c.tokens
                    ],
                    "inputs": {k: dense(v) for k, v in d.loss_fn_inputs.items()},
                }
                for d in fbi.data
            ],
        }
        (out / f"{name}.json").write_text(json.dumps(expected))


def sdk_view_of_sample(resp: types.SampleResponse) -> dict:
    def floats(xs):
        return (
            None
            if xs is None
            else [None if x is None or (isinstance(x, float) and math.isnan(x)) else x for x in xs]
        )

    return {
        "sequences": [
            {
                "stop_reason": s.stop_reason,
                "tokens": s.tokens,
                "logprobs": floats(s.logprobs),
                "topk": s.topk_logprobs,
            }
            for s in resp.sequences
        ],
        "prompt_logprobs": floats(resp.prompt_logprobs),
        "topk_prompt_logprobs": resp.topk_prompt_logprobs,
    }


def read_responses(out: Path) -> None:
    for path in sorted(out.glob("*.bin")):
        try:
            view = sdk_view_of_response(path.name, path.read_bytes())
        except Exception as e:  # reported per case, so that one bad body fails one test
            view = {"error": f"{type(e).__name__}: {e}"}
        path.with_suffix(".json").write_text(json.dumps(view))


def sdk_view_of_response(name: str, body: bytes) -> dict:
    if name.startswith("sample"):
        view = sdk_view_of_sample(response_conv.deserialize_sample_response(body))
        msg = pb.SampleResponse()
    else:
        result = response_conv.deserialize_forward_backward_output(body)
        view = {
            "loss_fn_output_type": result.loss_fn_output_type,
            "metrics": result.metrics,
            "outputs": [{k: dense(v) for k, v in d.items()} for d in result.loss_fn_outputs],
            # the SDK's fold of two chunks of one call (the same result twice)
            "combined_metrics": combine_fwd_bwd_output_results([result, result]).metrics,
        }
        msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(body)
    view["reserialized_hex"] = msg.SerializeToString(deterministic=True).hex()
    return view


def write_schema(out: Path) -> None:
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)

    def fields(msg) -> dict:
        entries = {}
        for f in msg.field:
            oneof = msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
            entries[f.name] = [f.number, f.type, f.label, f.type_name, oneof, f.proto3_optional]
        for nested in msg.nested_type:
            entries[f"<{nested.name}>"] = fields(nested)
        return entries

    schema = {m.name: fields(m) for m in fdp.message_type}
    schema["<enums>"] = {e.name: [[v.name, v.number] for v in e.value] for e in fdp.enum_type}
    (out / "schema.json").write_text(json.dumps(schema))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    write_requests(root / "requests")
    read_responses(root / "responses")
    write_schema(root)
