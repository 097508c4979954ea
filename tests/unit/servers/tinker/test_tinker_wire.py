"""The Tinker wire codec against the real SDK, byte for byte: request bodies built by the SDK's
own request conversion are decoded by ours; our response bodies are parsed by the SDK's own
response conversion (and re-serialized by its pb2 to the same bytes). The SDK runs in its own
virtualenv (``OPENALIGNER_TINKER_PYTHON``, default ``.venv-tinker/bin/python``, made by
``make tinker-setup``), once per module. Plus the errors: malformed bodies, and a fuzz run in
which truncated or mutated bodies raise WireError and nothing else."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from openaligner.servers.tinker import wire

REPO = Path(__file__).resolve().parents[4]
SDK_SCRIPT = Path(__file__).with_name("tinker_sdk_wire.py")
TINKER_PYTHON = Path(os.environ.get("OPENALIGNER_TINKER_PYTHON", REPO / ".venv-tinker" / "bin" / "python"))
needs_sdk = pytest.mark.skipif(
    not TINKER_PYTHON.exists(),
    reason=f"the tinker SDK's virtualenv is missing ({TINKER_PYTHON}): run `make tinker-setup` "
    "(or set OPENALIGNER_TINKER_PYTHON)",
)


class Seq:
    def __init__(self, tokens, logprobs, stop_reason):
        self.tokens, self.logprobs, self.stop_reason = (
            torch.tensor(tokens),
            torch.tensor(logprobs),
            stop_reason,
        )


NAN = float("nan")


def response_cases() -> dict[str, bytes]:
    """Our encoder's bodies, by case name (``sample*`` are SampleResponses)."""
    lp = [torch.tensor([-0.5, -1.25, -3.0]), torch.tensor([-0.125]), torch.tensor([-2.0, -0.0625])]
    el = [torch.tensor([0.5, 1.25, 3.0]), torch.tensor([0.0]), torch.tensor([-2.0, 0.0])]
    topk = [
        torch.full((2, 3), -1.5),
        torch.full((2, 3), -0.5),
        torch.full((4, 2), -2.0),
        torch.full((1, 3), -0.25),
    ]
    return {
        "fwdbwd_three": wire.encode_forward_backward_output(
            [{"logprobs": a, "elementwise_loss": b} for a, b in zip(lp, el, strict=True)],
            {"loss:sum": 7.5, "tokens:max": 3.0},
        ),
        "fwdbwd_ragged_topk": wire.encode_forward_backward_output(
            [{"logprobs": t} for t in topk], {"loss:sum": -1.0}
        ),
        "fwdbwd_int_field": wire.encode_forward_backward_output(
            [{"ids": torch.tensor([1, 2**40, -3])}, {"ids": torch.tensor([7])}], {}
        ),
        "fwdbwd_none": wire.encode_forward_backward_output([], {"loss:sum": 0.0}),
        "sample_two": wire.encode_sample_response(
            [Seq([5, 6, 2], [-0.5, -0.25, -0.125], "stop"), Seq([9, 9], [-1.0, -2.0], "length")],
            torch.tensor([NAN, -1.5, -2.5, -0.75]),
            topk_prompt_logprobs=wire.TopkLogprobs(
                torch.tensor([[0, 0], [3, 4], [5, 0], [6, 7]]),
                torch.tensor(
                    [
                        [wire.TOPK_EMPTY_LOGPROB] * 2,
                        [-0.1, -2.0],
                        [-0.2, wire.TOPK_EMPTY_LOGPROB],
                        [-0.3, -0.4],
                    ]
                ),
            ),
            topk_sample_logprobs=[
                wire.TopkLogprobs(torch.tensor([[5], [6], [2]]), torch.tensor([[-0.5], [-0.25], [-0.125]])),
                wire.TopkLogprobs(torch.tensor([[9], [8]]), torch.tensor([[-1.0], [-1.5]])),
            ],
        ),
        "sample_plain": wire.encode_sample_response([Seq([1], [-0.5], "length")], None),
        "sample_empty_sequence": wire.encode_sample_response([Seq([], [], "length")], None),
    }


def served_sample_cases() -> dict[str, bytes]:
    """SampleResponses from the server's own sampling path at its shortest: every token id a stop
    id, so the first token ends each sample (``max_tokens`` 1 and 4). The server never sends a
    zero-token sample (the SDK would read its empty log-probs as None, which the cookbook's
    completer asserts against): the stop token is kept, with its log-prob."""
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.rollout.hf_engine import HFRolloutEngine
    from openaligner.servers.tinker.sampling import TinkerSampling, sample

    vocab = 40
    model = build_tiny_causal_lm(
        "llama", TinySize(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2), seed=0
    )
    cases = {}
    for max_tokens in (1, 4):
        params = TinkerSampling.parse(
            {"max_tokens": max_tokens, "stop": list(range(vocab)), "seed": 0},
            default_max_tokens=1,
            vocab_size=vocab,
        )
        seqs, _ = sample(
            HFRolloutEngine(CausalLMActor(model, None, init_policy=False)),
            model,
            torch.tensor([3, 4, 5]),
            2,
            params,
            tokenizer=None,
            prompt_logprobs=False,
        )
        cases[f"sample_served_first_token_stops_{max_tokens}"] = wire.encode_sample_response(seqs, None)
    return cases


@pytest.fixture(scope="module")
def sdk(tmp_path_factory) -> Path:
    """The directory the SDK script filled (one process start for the whole module)."""
    if not TINKER_PYTHON.exists():
        pytest.skip(f"the tinker SDK's virtualenv is missing ({TINKER_PYTHON}): run `make tinker-setup`")
    root = tmp_path_factory.mktemp("tinker_wire")
    (root / "responses").mkdir()
    for name, body in {**response_cases(), **served_sample_cases()}.items():
        (root / "responses" / f"{name}.bin").write_bytes(body)
    subprocess.run([str(TINKER_PYTHON), str(SDK_SCRIPT), str(root)], check=True, cwd=root, timeout=300)
    return root


def sdk_request(sdk: Path, name: str) -> tuple[bytes, dict]:
    return (sdk / "requests" / f"{name}.bin").read_bytes(), json.loads(
        (sdk / "requests" / f"{name}.json").read_text()
    )


def assert_decoded_as_the_sdk_meant(decoded: wire.ForwardBackwardRequest, expected: dict) -> None:
    assert decoded.model_id == expected["model_id"]
    assert decoded.seq_id == expected["seq_id"]
    assert decoded.loss_fn == expected["loss_fn"]
    assert dict(decoded.loss_fn_config) == expected["loss_fn_config"]
    assert decoded.forward_only == expected["forward_only"]
    assert len(decoded.datums) == len(expected["datums"])
    for datum, want in zip(decoded.datums, expected["datums"], strict=True):
        assert datum.tokens.dtype == torch.int64 and datum.tokens.tolist() == want["tokens"]
        assert sorted(datum.inputs) == sorted(want["inputs"])
        for key, tensor in datum.inputs.items():
            w = want["inputs"][key]
            assert tensor.dtype == {"float32": torch.float32, "int64": torch.int64}[w["dtype"]], key
            assert list(tensor.shape) == w["shape"], key
            assert tensor.flatten().tolist() == w["data"], key  # exact: float32 round-trips


# -- requests from the SDK --------------------------------------------------------------------------


@needs_sdk
@pytest.mark.parametrize(
    "name",
    ["rl_ppo", "ce_two_datums", "ce_sparse_topk", "dro_text_config", "forward_only", "no_data", "provenance"],
)
def test_the_sdks_forward_backward_requests_decode_to_what_it_meant(sdk, name):
    body, expected = sdk_request(sdk, name)
    assert_decoded_as_the_sdk_meant(wire.decode_forward_backward_request(body, "identity"), expected)


@needs_sdk
def test_config_numbers_come_as_floats_and_text_as_text(sdk):
    decoded = wire.decode_forward_backward_request(sdk_request(sdk, "dro_text_config")[0])
    assert decoded.loss_fn_config == {"beta": 0.05, "variant": "soft"}
    ppo = wire.decode_forward_backward_request(sdk_request(sdk, "rl_ppo")[0])
    assert ppo.loss_fn_config == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    assert ppo.seq_id == 7 and ppo.model_id == "sess-1:train:0"


@needs_sdk
def test_an_image_chunk_is_refused_naming_the_datum_and_chunk(sdk):
    with pytest.raises(
        wire.WireError, match=r"data\[1\]\.model_input\[1\]: is a image chunk; .*encoded_text"
    ) as e:
        wire.decode_forward_backward_request(sdk_request(sdk, "image_chunk")[0])
    assert e.value.http_status == 400


@needs_sdk
def test_a_zstd_body_is_refused_with_415_saying_to_send_it_uncompressed(sdk):
    with pytest.raises(
        wire.WireError, match=r"Content-Encoding: 'zstd' is not accepted: send the body uncompressed"
    ) as e:
        wire.decode_forward_backward_request(sdk_request(sdk, "zstd")[0], "zstd")
    assert e.value.http_status == 415


# -- responses read by the SDK ----------------------------------------------------------------------


def sdk_view(sdk: Path, name: str) -> dict:
    view = json.loads((sdk / "responses" / f"{name}.json").read_text())
    assert "error" not in view, f"the SDK could not read our {name} body: {view.get('error')}"
    return view


@needs_sdk
@pytest.mark.parametrize("name", sorted(response_cases()))
def test_the_sdks_pb2_reserializes_our_bytes_identically(sdk, name):
    assert bytes.fromhex(sdk_view(sdk, name)["reserialized_hex"]) == response_cases()[name]


@needs_sdk
def test_the_sdk_reads_our_forward_backward_output(sdk):
    view = sdk_view(sdk, "fwdbwd_three")
    assert view["loss_fn_output_type"] == "ArrayRecord"
    assert view["metrics"] == {"loss:sum": 7.5, "tokens:max": 3.0}
    # two chunks of one call fold as the keys say: sum adds, max keeps the max
    assert view["combined_metrics"] == {"loss:sum": 15.0, "tokens:max": 3.0}
    assert [d["logprobs"] for d in view["outputs"]] == [
        {"dtype": "float32", "shape": [3], "data": [-0.5, -1.25, -3.0]},
        {"dtype": "float32", "shape": [1], "data": [-0.125]},
        {"dtype": "float32", "shape": [2], "data": [-2.0, -0.0625]},
    ]
    assert view["outputs"][2]["elementwise_loss"]["data"] == [-2.0, 0.0]


@needs_sdk
def test_the_sdk_reads_ragged_topk_outputs_from_several_records(sdk):
    shapes = [d["logprobs"]["shape"] for d in sdk_view(sdk, "fwdbwd_ragged_topk")["outputs"]]
    assert shapes == [[2, 3], [2, 3], [4, 2], [1, 3]]
    assert sdk_view(sdk, "fwdbwd_ragged_topk")["outputs"][2]["logprobs"]["data"] == [-2.0] * 8


@needs_sdk
def test_the_sdk_reads_integer_fields_and_empty_outputs(sdk):
    ids = [d["ids"] for d in sdk_view(sdk, "fwdbwd_int_field")["outputs"]]
    assert ids == [
        {"dtype": "int64", "shape": [3], "data": [1, 2**40, -3]},
        {"dtype": "int64", "shape": [1], "data": [7]},
    ]
    none = sdk_view(sdk, "fwdbwd_none")
    assert none["outputs"] == [] and none["metrics"] == {"loss:sum": 0.0}


@needs_sdk
def test_the_sdk_reads_our_sample_response(sdk):
    view = sdk_view(sdk, "sample_two")
    first, second = view["sequences"]
    assert first["stop_reason"] == "stop" and first["tokens"] == [5, 6, 2]
    assert first["logprobs"] == [-0.5, -0.25, -0.125]
    assert (
        second["stop_reason"] == "length"
        and second["tokens"] == [9, 9]
        and second["logprobs"] == [-1.0, -2.0]
    )
    # NaN at position 0 reads as None (nothing predicts the first prompt token)
    assert view["prompt_logprobs"] == [None, -1.5, -2.5, -0.75]
    # a row of sentinels reads as None; trailing sentinels are dropped
    assert view["topk_prompt_logprobs"] == [
        None,
        [[3, pytest.approx(-0.1)], [4, -2.0]],
        [[5, pytest.approx(-0.2)]],
        [[6, pytest.approx(-0.3)], [7, pytest.approx(-0.4)]],
    ]
    assert first["topk"] == [[[5, -0.5]], [[6, -0.25]], [[2, -0.125]]]
    assert second["topk"] == [[[9, -1.0]], [[8, -1.5]]]


@needs_sdk
def test_the_sdk_reads_a_plain_sample_and_an_empty_one(sdk):
    plain = sdk_view(sdk, "sample_plain")
    assert plain["sequences"] == [{"stop_reason": "length", "tokens": [1], "logprobs": [-0.5], "topk": None}]
    assert plain["prompt_logprobs"] is None and plain["topk_prompt_logprobs"] is None
    # zero tokens: the SDK reads the empty logprobs as None (a limit of its decoder, documented)
    assert sdk_view(sdk, "sample_empty_sequence")["sequences"][0]["logprobs"] is None


@needs_sdk
@pytest.mark.parametrize("max_tokens", [1, 4])
def test_a_served_sample_that_stops_at_once_reaches_the_sdk_with_a_list_of_logprobs(sdk, max_tokens):
    sequences = sdk_view(sdk, f"sample_served_first_token_stops_{max_tokens}")["sequences"]
    assert len(sequences) == 2
    for seq in sequences:
        assert seq["stop_reason"] == "stop" and len(seq["tokens"]) == 1
        assert isinstance(seq["logprobs"], list) and len(seq["logprobs"]) == 1
        assert math.isfinite(seq["logprobs"][0]) and seq["logprobs"][0] <= 0


@needs_sdk
def test_our_schema_has_the_sdks_field_numbers_types_and_names(sdk):
    theirs = json.loads((sdk / "schema.json").read_text())
    fdp = wire._file_descriptor()
    ours_enums = {e.name: [[v.name, v.number] for v in e.value] for e in fdp.enum_type}
    assert ours_enums == theirs["<enums>"]
    for msg in fdp.message_type:
        entries = {}
        for f in msg.field:
            oneof = msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
            entries[f.name] = [f.number, f.type, f.label, f.type_name, oneof, f.proto3_optional]
        for nested in msg.nested_type:
            entries[f"<{nested.name}>"] = {
                f.name: [f.number, f.type, f.label, f.type_name, None, False] for f in nested.field
            }
        assert entries == theirs[msg.name], msg.name


# -- malformed bodies -------------------------------------------------------------------------------


def body(**fields) -> bytes:
    """A ForwardBackwardRequest in our schema (to build bodies the SDK would never send)."""
    msg = wire._ForwardBackwardRequest(**fields)
    return msg.SerializeToString()


def datum_with(tensor: dict, tokens: bytes = b"\x01\x00\x00\x00\x02\x00\x00\x00") -> dict:
    return {"model_input": [{"encoded_text": {"tokens": tokens}}], "loss_fn_inputs": {"weights": tensor}}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"data": [datum_with({"dtype": 3, "dense": b"\0" * 8})]},
            r"data\[0\]\.loss_fn_inputs\['weights'\]\.dtype: is 3, expected FLOAT32",
        ),
        (
            {"data": [datum_with({"dtype": 1, "dense": b"\0" * 7})]},
            r"\.dense: has 7 bytes, expected a multiple of 4 \(float32\)",
        ),
        (
            {"data": [datum_with({"dtype": 1, "dense": b"\0" * 8, "shape": [3]})]},
            r"\.dense: holds 2 values, but shape \[3\] needs 3",
        ),
        (
            {"data": [datum_with({"dtype": 1, "shape": [2]})]},
            r"\['weights'\]: has neither dense nor sparse_csr data",
        ),
        (
            {"data": [datum_with({"dtype": 1, "dense": b"", "shape": [-1]})]},
            r"\.shape: \[-1\] has a negative dimension",
        ),
        (
            {"data": [datum_with({"dtype": 1, "dense": b"", "shape": [2**20, 2**20]})]},
            r"holds more than \d+ elements",
        ),
        (
            {"data": [datum_with({"dtype": 1, "dense": b"\0" * 8}, tokens=b"\x01\x00\x00")]},
            r"encoded_text\.tokens: has 3 bytes, expected a multiple of 4",
        ),
        (
            {"data": [datum_with({"dtype": 1, "dense": b"\0" * 8}, tokens=b"\xff\xff\xff\xff")]},
            r"holds a negative token id",
        ),
        ({"data": [{"model_input": [{}]}]}, r"data\[0\]\.model_input\[0\]: is an empty chunk"),
        (
            {"loss_fn_config_v2": {"beta": {}}},
            r"loss_fn_config_v2\['beta'\]: has neither a number nor a text value",
        ),
    ],
)
def test_malformed_fields_are_refused_naming_the_field_and_what_was_expected(fields, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_forward_backward_request(body(**fields))


def csr(values: list[float], crow: list[int], col: list[int], shape: list[int]) -> dict:
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64).numpy().astype("<i8").tobytes()  # noqa: E731
    return {
        "dtype": 1,
        "shape": shape,
        "sparse_csr": {
            "values": torch.tensor(values).numpy().astype("<f4").tobytes(),
            "crow_indices": i64(crow),
            "col_indices": i64(col),
        },
    }


def test_a_good_csr_tensor_densifies_with_zeros():
    decoded = wire.decode_forward_backward_request(
        body(data=[datum_with(csr([1.5, 2.5], [0, 1, 1, 2], [2, 0], [3, 3]))])
    )
    assert decoded.datums[0].inputs["weights"].tolist() == [[0, 0, 1.5], [0, 0, 0], [2.5, 0, 0]]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (csr([1.0], [0, 1], [0], [2, 2]), r"crow_indices: expected 3 non-decreasing row pointers"),
        (csr([1.0], [0, 2, 1], [0], [2, 2]), r"crow_indices: expected 3 non-decreasing"),
        (
            csr([1.0, 2.0], [0, 1, 2], [0], [2, 2]),
            r"crow_indices|col_indices: has 1 entries, expected one per value \(2\)",
        ),
        (csr([1.0], [0, 1, 1], [5], [2, 2]), r"col_indices: expected column indices in \[0, 2\)"),
        (csr([1.0, 2.0], [0, 2, 2], [1, 1], [2, 2]), r"strictly increasing column indices within each row"),
        (csr([1.0], [0, 1], [0], [4]), r"sparse_csr: needs a 2-D shape \(rows, columns\), got \[4\]"),
        (csr([], [0] * 3, [], [2, 2**40]), r"holds more than \d+ elements"),
    ],
)
def test_bad_csr_tensors_are_refused(tensor, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_forward_backward_request(body(data=[datum_with(tensor)]))


def test_a_legacy_only_config_is_read_as_floats():
    assert wire.decode_forward_backward_request(body(loss_fn_config={"beta": 0.5})).loss_fn_config == {
        "beta": 0.5
    }


def test_garbage_is_refused_as_not_protobuf():
    with pytest.raises(
        wire.WireError, match=r"ForwardBackwardRequest: not a valid protobuf ForwardBackwardRequest"
    ):
        wire.decode_forward_backward_request(b"\xff\xff\xff\xff\xff")


def own_seed_bodies() -> list[bytes]:
    """Bodies in our schema covering what the SDK sends: text chunks, dense and CSR tensors of
    both dtypes, both config maps, provenance spans."""
    spans = [{"prompt_tokens": {"sequence_id": "s0", "length": 2}}, {"sampled_tokens": {"sequence_id": "s1"}}]
    dense_ids = {"dtype": 2, "dense": torch.tensor([3, 4]).numpy().astype("<i8").tobytes(), "shape": [2]}
    rich = {
        "model_input": [
            {"encoded_text": {"tokens": b"\x01\x00\x00\x00"}},
            {"encoded_text": {"tokens": b"\x02\x00\x00\x00"}},
        ],
        "loss_fn_inputs": {
            "target_tokens": dense_ids,
            "weights": {"dtype": 1, "dense": b"\x00\x00\x80?" * 2},
        },
        "model_input_spans": spans,
    }
    return [
        body(
            model_id="m:train:0",
            seq_id=3,
            loss_fn="ppo",
            data=[rich],
            loss_fn_config={"clip_low_threshold": 0.8},
        ),
        body(
            data=[datum_with(csr([1.5, 2.5], [0, 1, 1, 2], [2, 0], [3, 3]))],
            loss_fn_config_v2={"beta": {"number": 0.1}, "m": {"text": "x"}},
        ),
    ]


def fuzz(seeds: list[bytes], rounds: int) -> dict[str, int]:
    """Truncate, overwrite, insert into the seeds or make up bytes: each decodes to well-formed
    tensors or raises WireError, and nothing else."""
    rng = random.Random(0)
    outcomes = {"decoded": 0, "refused": 0}
    for i in range(rounds):
        raw = bytearray(rng.choice(seeds))
        kind = i % 4
        if kind == 0:
            raw = raw[: rng.randrange(len(raw))]
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif kind == 2:
            start = rng.randrange(len(raw))
            raw[start:start] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            raw = bytearray(rng.randbytes(rng.randint(0, 64)))
        try:
            decoded = wire.decode_forward_backward_request(bytes(raw))
        except wire.WireError:
            outcomes["refused"] += 1
        else:
            outcomes["decoded"] += 1
            for d in decoded.datums:
                assert d.tokens.dtype == torch.int64 and d.tokens.dim() == 1
                assert all(t.dtype in (torch.float32, torch.int64) for t in d.inputs.values())
    return outcomes


def test_fuzz_truncated_and_mutated_bodies_raise_wire_error_and_nothing_else():
    outcomes = fuzz(own_seed_bodies(), 2000)
    assert outcomes["refused"] > 100 and outcomes["decoded"] > 100, outcomes


@needs_sdk
def test_fuzz_the_sdks_own_bodies(sdk):
    seeds = [sdk_request(sdk, n)[0] for n in ("rl_ppo", "ce_sparse_topk", "dro_text_config", "provenance")]
    outcomes = fuzz(seeds, 2000)
    assert outcomes["refused"] > 100 and outcomes["decoded"] > 100, outcomes


# -- JSON TensorData --------------------------------------------------------------------------------


def test_json_tensor_data_dense_and_sparse():
    assert wire.tensor_from_json({"data": [1.5, 2.0], "dtype": "float32"}, "x").tolist() == [1.5, 2.0]
    t = wire.tensor_from_json({"data": [1, 2, 3, 4, 5, 6], "dtype": "int64", "shape": [2, 3]}, "x")
    assert t.dtype == torch.int64 and t.tolist() == [[1, 2, 3], [4, 5, 6]]
    sparse = {
        "data": [7],
        "dtype": "int64",
        "shape": [2, 2],
        "sparse_crow_indices": [0, 0, 1],
        "sparse_col_indices": [1],
    }
    # target_prompt_logprobs' unlisted cells request nothing: -1
    assert wire.tensor_from_json(sparse, "target_prompt_logprobs", pad_value=-1).tolist() == [
        [-1, -1],
        [-1, 7],
    ]


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1, 2], r"x: expected a TensorData object"),
        ({"data": [1], "dtype": "int32"}, r"x\.dtype: is 'int32', expected 'float32' or 'int64'"),
        ({"data": [1.5], "dtype": "int64"}, r"x\.data\[0\]: is 1\.5, expected an integer"),
        ({"data": [True], "dtype": "float32"}, r"x\.data\[0\]: is True, expected a number"),
        ({"data": "abc", "dtype": "float32"}, r"x\.data: expected a list of numbers, got str"),
        (
            {"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]},
            r"holds 3 values, but shape \[2, 2\] needs 4",
        ),
        ({"data": [2**63], "dtype": "int64"}, r"outside int64"),
        ({"data": [1.0], "dtype": "float32", "extra": 1}, r"unknown key\(s\) \['extra'\]"),
        (
            {"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 1]},
            r"needs sparse_crow_indices, sparse_col_indices and shape",
        ),
        (
            {
                "data": [1],
                "dtype": "int64",
                "shape": [2, 2],
                "sparse_crow_indices": [0, 1, 1],
                "sparse_col_indices": [9],
            },
            r"column indices in \[0, 2\)",
        ),
        (
            {
                "data": [],
                "dtype": "int64",
                "shape": [2**31, 2**31],
                "sparse_crow_indices": [],
                "sparse_col_indices": [],
            },
            r"holds more than",
        ),
    ],
)
def test_bad_json_tensor_data_is_refused_naming_the_field(obj, message):
    with pytest.raises(wire.WireError, match=message):
        wire.tensor_from_json(obj, "x")


# -- the encoders' own contract -------------------------------------------------------------------


def test_encoders_refuse_what_the_server_must_never_send():
    with pytest.raises(ValueError, match="name:reduction"):
        wire.encode_forward_backward_output([], {"loss": 1.0})
    with pytest.raises(ValueError, match=r"datum 1 has output fields \['a'\], datum 0 has \['b'\]"):
        wire.encode_forward_backward_output([{"b": torch.zeros(1)}, {"a": torch.zeros(1)}], {})
    with pytest.raises(ValueError, match="stop_reason 'eos'"):
        wire.encode_sample_response([Seq([1], [-1.0], "eos")])
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        wire.encode_sample_response([Seq([1, 2], [-1.0], "stop")])


def test_prompt_logprobs_keep_nan_bytes():
    raw = wire.encode_sample_response([], torch.tensor([NAN, -1.0]))
    msg = wire._SampleResponse()
    msg.ParseFromString(raw)
    values = torch.frombuffer(bytearray(msg.prompt_logprobs), dtype=torch.float32)
    assert math.isnan(values[0]) and values[1] == -1.0
