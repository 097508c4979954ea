"""Security properties of the served endpoints, checked on real servers.

Most tests use the deployed servers (``openaligner serve-reward`` / ``serve-critic`` subprocesses,
the critic's token taken from ``$OPENALIGNER_TOKEN``); one in-process reward server is bound to
every interface with a small body limit.

* Bind address: loopback by default — every listening socket of the deployed servers' process
  trees is on 127.0.0.1 — and a warning when a non-loopback address is bound (Triton itself then
  still listens on loopback only, behind the HTTP front).
* Shared secret: ``critic_train`` and ``critic_save`` refuse a missing or wrong token with a clear
  error and change nothing (same values, no files); the right token trains and saves;
  ``critic_infer`` needs none; the token is never echoed or logged.
* No client-chosen paths: ``critic_save`` declares no path input, refuses extra inputs and ignores
  request parameters; checkpoints land only in the configured directory.
* Size limits: rows per request, sequence length (the model's position limit by default, as
  deployed by the CLI), request body size (413 before the body is read, including a declared
  Content-Length far over the limit), compressed bodies refused unread (a gzip bomb), shapes that
  would make tritonserver allocate terabytes; Triton's control routes are not reachable. After
  every refusal the server answers the next request.
"""

from __future__ import annotations

import gzip
import http.client
import ipaddress
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from procs import descendants, free_port
from support import (
    MAX_BATCH,
    POSITIONS,
    Memory,
    array_json,
    binary_body,
    files_under,
    infer_path,
    json_body,
    post,
    reward_server,
    tensor,
    valid_infer_body,
)

from openaligner.cli.serve_critic import ServeCriticConfig
from openaligner.cli.serve_reward import ServeRewardConfig
from openaligner.models.source import ModelSourceConfig
from openaligner.protocol import DEFAULT_HOST, TOKEN_ENV, TOKEN_PARAMETER
from openaligner.servers.critic import CriticServerConfig
from openaligner.servers.reward import RewardModelServer, RewardServerConfig
from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES
from openaligner.servers.transport.triton import TritonHost

pytestmark = pytest.mark.reliability

BODY_LIMIT = 64 * 1024


# ---------------------------------------------------------------------------- helpers
def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket held by ``pid`` or its descendants."""
    inodes: set[str] = set()
    for p in (pid, *descendants(pid)):
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except OSError:  # the process is gone
            continue
        for fd in fds:
            try:
                link = fd.readlink().as_posix()
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A = LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # the kernel prints each 32-bit word little-endian
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(words)), int(port, 16)))
    return found


def reward_infer(port: int) -> np.ndarray:
    return post(port, infer_path("reward_model"), valid_infer_body()).outputs()["rewards"]


def train_body(parameters: dict | None) -> tuple[bytes, dict[str, str]]:
    rng = np.random.default_rng(7)
    arrays = {
        "tokens": rng.integers(3, 100, (4, 8)).astype(np.int64),
        "returns": np.full((4, 7), 0.5, np.float32),
        "prev_values": np.zeros((4, 7), np.float32),
        "mask": np.ones((4, 7), np.float32),
    }
    return binary_body(arrays, parameters)


def save_body(parameters: dict | None, extra: dict[str, np.ndarray] | None = None) -> tuple[bytes, dict]:
    return binary_body({"dummy_var": np.zeros(1, np.int64), **(extra or {})}, parameters)


# ---------------------------------------------------------------------------- servers
class Recorder(logging.Handler):
    """Keeps the log records it sees."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def exposed_reward(tiny):
    """A reward server bound to every interface with a small body limit, and the warnings its
    start logged."""
    server = reward_server(tiny, free_port(), host="0.0.0.0", max_request_bytes=BODY_LIMIT)
    recorder, logger = Recorder(), logging.getLogger("openaligner.servers")
    logger.addHandler(recorder)
    try:
        server.start()
    finally:
        logger.removeHandler(recorder)
    yield server, [r.getMessage() for r in recorder.records]
    server.stop()


def critic_values(port: int) -> dict[str, np.ndarray]:
    return post(port, infer_path("critic_infer"), valid_infer_body()).outputs()


# ---------------------------------------------------------------------------- bind address
def test_every_server_binds_loopback_by_default(cli_servers):
    assert DEFAULT_HOST == "127.0.0.1"
    assert (
        RewardServerConfig().host
        == CriticServerConfig().host
        == ServeRewardConfig(model=ModelSourceConfig()).server.host
        == ServeCriticConfig(model=ModelSourceConfig()).server.host
        == DEFAULT_HOST
    )
    assert RewardModelServer(infer_fn=lambda t, n: t).cfg.host == DEFAULT_HOST
    for served, port in (
        (cli_servers.reward, cli_servers.reward_port),
        (cli_servers.critic, cli_servers.critic_port),
    ):
        sockets = listening_sockets(served.proc.pid)
        assert ("127.0.0.1", port) in sockets, sockets  # the served address
        assert len(sockets) >= 2, sockets  # and tritonserver's own port behind it
        assert all(ipaddress.ip_address(a).is_loopback for a, _ in sockets), sockets


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_addresses_are_not_warned_about(host, caplog):
    with caplog.at_level(logging.WARNING, logger="openaligner.servers.transport.triton"):
        TritonHost(host, free_port())
    assert not caplog.records


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_non_loopback_addresses_are_warned_about(host, caplog):
    with caplog.at_level(logging.WARNING, logger="openaligner.servers.transport.triton"):
        TritonHost(host, 8000)
    assert f"binding {host}:8000, which is reachable from other machines" in caplog.text
    assert "no authentication" in caplog.text


def test_a_server_bound_to_all_interfaces_warns_and_keeps_triton_on_loopback(exposed_reward):
    server, warnings = exposed_reward
    assert any(
        f"binding 0.0.0.0:{server.cfg.port}, which is reachable from other machines" in w for w in warnings
    )
    assert reward_infer(server.cfg.port).shape == (2, 1)
    assert server.triton is not None and server.triton.triton_port is not None
    sockets = listening_sockets(os.getpid())
    assert ("0.0.0.0", server.cfg.port) in sockets and ("127.0.0.1", server.triton.triton_port) in sockets


# ---------------------------------------------------------------------------- token
def test_train_and_save_without_the_token_are_refused_and_change_nothing(cli_servers):
    port = cli_servers.critic_port
    values, files = critic_values(port), files_under(cli_servers.critic_ckpt)
    for model, (body, headers) in (("critic_train", train_body(None)), ("critic_save", save_body(None))):
        answer = post(port, infer_path(model), body, headers)
        assert answer.status >= 400
        assert f"{model}: this endpoint needs the server's token (request parameter '{TOKEN_PARAMETER}')" in (
            answer.error
        )
        assert f"${TOKEN_ENV}" in answer.error  # says where the token comes from
    assert_same_values(values, critic_values(port))
    assert files_under(cli_servers.critic_ckpt) == files


@pytest.mark.parametrize("wrong", ["", "x", "TOKEN+x", "TOKEN.upper", "TOKEN[:-1]", 12345, True])
def test_a_wrong_token_is_refused_changes_nothing_and_is_not_echoed(cli_servers, wrong):
    port, token = cli_servers.critic_port, cli_servers.token
    wrong = {"TOKEN+x": token + "x", "TOKEN.upper": token.upper(), "TOKEN[:-1]": token[:-1]}.get(wrong, wrong)
    values, files = critic_values(port), files_under(cli_servers.critic_ckpt)
    for model, (body, headers) in (
        ("critic_train", train_body({TOKEN_PARAMETER: wrong})),
        ("critic_save", save_body({TOKEN_PARAMETER: wrong})),
    ):
        answer = post(port, infer_path(model), body, headers)
        assert answer.status >= 400 and f"{model}: the request's token does not match the server's" in (
            answer.error
        )
        assert token not in answer.error
    assert_same_values(values, critic_values(port))
    assert files_under(cli_servers.critic_ckpt) == files


def test_the_right_token_trains_and_saves_and_infer_needs_none(cli_servers):
    port, token, ckpt = cli_servers.critic_port, cli_servers.token, cli_servers.critic_ckpt
    before = critic_values(port)  # infer: no token
    trained = post(port, infer_path("critic_train"), *train_body({TOKEN_PARAMETER: token}))
    assert trained.status == 200, trained.error
    after = critic_values(port)
    assert not np.array_equal(after["values"], before["values"])  # the critic learned
    np.testing.assert_array_equal(after["rewards"], before["rewards"])  # the reward model did not
    saved = post(port, infer_path("critic_save"), *save_body({TOKEN_PARAMETER: token}))
    assert saved.status == 200, saved.error
    step = int(json.loads(saved.body)["outputs"][1]["data"][0])
    assert (ckpt / f"step_{step}").is_dir()
    assert "need the token" in cli_servers.critic.output  # the start-up line says so
    assert token not in cli_servers.critic.output  # and the secret itself is never logged


def assert_same_values(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


# ---------------------------------------------------------------------------- paths
def test_critic_save_declares_no_path_input(cli_servers):
    conn = http.client.HTTPConnection("127.0.0.1", cli_servers.critic_port, timeout=10)
    try:
        conn.request("GET", "/v2/models/critic_save")
        metadata = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    # dummy_var, and the critic step restore_step names (a number: the server picks step_<N> under
    # its own checkpoint.dir); nothing a path could travel in
    assert [(i["name"], i["datatype"], i["shape"]) for i in metadata["inputs"]] == [
        ("dummy_var", "INT64", [1]),
        ("restore_step", "INT64", [1]),
    ]


def test_critic_save_refuses_path_inputs_and_ignores_path_parameters(cli_servers, tmp_path):
    port, token, ckpt = cli_servers.critic_port, cli_servers.token, cli_servers.critic_ckpt
    trained = post(port, infer_path("critic_train"), *train_body({TOKEN_PARAMETER: token}))
    assert trained.status == 200, trained.error  # a new step, so that a save writes new files
    evil = tmp_path / "evil"
    targets = [evil / "ckpt", ckpt.parent / "escape", Path("/tmp") / f"openaligner-evil-{port}"]
    watched = [tmp_path, ckpt.parent]
    files = set().union(*(files_under(d) for d in watched))
    for name in ("path", "checkpoint_dir", "dir", "filename"):
        for target in targets:
            extra = {name: np.array([str(target).encode()], dtype=object)}
            answer = post(port, infer_path("critic_save"), *save_body({TOKEN_PARAMETER: token}, extra))
            assert (
                answer.status == 400 and f"'{name}'" in answer.error and "unexpected input(s)" in answer.error
            )
    assert set().union(*(files_under(d) for d in watched)) == files
    step_dirs = set(ckpt.glob("step_*"))
    parameters = {TOKEN_PARAMETER: token, "path": str(targets[0]), "checkpoint_dir": "../../escape"}
    parameters |= {"dir": str(targets[2]), "output_dir": str(evil)}
    saved = post(port, infer_path("critic_save"), *save_body(parameters))
    assert saved.status == 200, saved.error
    assert not any(t.exists() for t in targets) and not evil.exists()
    new = set().union(*(files_under(d) for d in watched)) - files
    assert new and all(ckpt in p.parents for p in new), sorted(new)
    assert len(set(ckpt.glob("step_*")) - step_dirs) == 1


# ---------------------------------------------------------------------------- size limits
def test_too_many_rows_are_refused_and_the_server_goes_on(exposed_reward):
    server, _ = exposed_reward
    rows = MAX_BATCH + 1
    tokens, lengths = np.full((rows, 4), 5, np.int64), np.full((rows, 1), 4, np.int64)
    body = json_body([array_json("tokens", tokens), array_json("sequence_lengths", lengths)])
    answer = post(server.cfg.port, infer_path("reward_model"), body)
    assert answer.status == 400 and f"accepts at most {MAX_BATCH} per request" in answer.error
    assert reward_infer(server.cfg.port).shape == (2, 1)


def test_the_deployed_servers_limit_sequences_to_the_models_positions(cli_servers):
    width = POSITIONS + 1
    tokens, lengths = np.full((1, width), 5, np.int64), np.array([[width]], np.int64)
    body, headers = binary_body({"tokens": tokens, "sequence_lengths": lengths})
    for port, model in ((cli_servers.reward_port, "reward_model"), (cli_servers.critic_port, "critic_infer")):
        answer = post(port, infer_path(model), body, headers)
        assert answer.status >= 400
        assert (
            f"row 0 has {width} tokens, more than the server's max_sequence_length {POSITIONS}"
            in answer.error
        )
        assert post(port, infer_path(model), valid_infer_body()).status == 200


def test_a_body_over_the_limit_is_refused_before_it_is_read(exposed_reward):
    port = exposed_reward[0].cfg.port
    before = reward_infer(port)
    width = BODY_LIMIT // 2  # ", 5" is 3 bytes a token
    big = json_body(
        [
            tensor("tokens", "INT64", [1, width], [5] * width),
            tensor("sequence_lengths", "INT64", [1, 1], [4]),
        ]
    )
    assert len(big) > BODY_LIMIT
    answer = post(port, infer_path("reward_model"), big)
    assert answer.status == 413
    assert f"over this server's limit of {BODY_LIMIT} bytes (max_request_bytes)" in answer.error
    np.testing.assert_array_equal(reward_infer(port), before)


def declared_length_answer(port: int, declared: int) -> tuple[int, str]:
    """Announce a ``declared``-byte body, send 10 bytes, and read what the server says."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", infer_path("reward_model"))
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(declared))
        conn.endheaders()
        conn.send(b'{"inputs":')
        response = conn.getresponse()
        return response.status, json.loads(response.read())["error"]
    finally:
        conn.close()


def test_a_declared_length_over_the_limit_is_refused_at_once(cli_servers, exposed_reward):
    status, error = declared_length_answer(cli_servers.reward_port, DEFAULT_MAX_REQUEST_BYTES + 1)
    assert status == 413 and f"{DEFAULT_MAX_REQUEST_BYTES + 1} bytes, over this server's limit" in error
    status, error = declared_length_answer(exposed_reward[0].cfg.port, 10 * 2**30)
    assert status == 413 and f"limit of {BODY_LIMIT} bytes" in error
    assert reward_infer(cli_servers.reward_port).shape == (2, 1)


def test_a_gzip_bomb_is_refused_unread(cli_servers):
    bomb = gzip.compress(b"\0" * (256 * 2**20), compresslevel=9)  # 256 MiB of zeros in ~250 kB
    assert len(bomb) < 2**20
    pid = cli_servers.reward.proc.pid
    before = Memory.of(pid)
    answer = post(cli_servers.reward_port, infer_path("reward_model"), bomb, {"Content-Encoding": "gzip"})
    assert answer.status == 415 and "Content-Encoding: gzip" in answer.error
    assert Memory.of(pid).tree_kb - before.tree_kb < 64 * 1024  # nothing was inflated
    assert reward_infer(cli_servers.reward_port).shape == (2, 1)


@pytest.mark.parametrize("shape", [[1, 10**12], [2**31, 2**31], [1, 10**9]])
def test_a_shape_far_larger_than_its_data_is_refused_without_allocating(cli_servers, shape):
    # tritonserver 2.51 allocates prod(shape) x 8 bytes for JSON data before reading it: this request
    # aborted it (std::bad_alloc) or, for [1, 10**9], made it fill 8 GB
    pid = cli_servers.reward.proc.pid
    before = Memory.of(pid).tree_kb
    body = json_body(
        [tensor("tokens", "INT64", shape, [5, 6, 7]), tensor("sequence_lengths", "INT64", [1, 1], [3])]
    )
    answer = post(cli_servers.reward_port, infer_path("reward_model"), body)
    assert (
        answer.status == 400 and "input 'tokens': shape" in answer.error and "'data' holds 3" in answer.error
    )
    assert Memory.of(pid).tree_kb - before < 64 * 1024
    assert reward_infer(cli_servers.reward_port).shape == (2, 1)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/repository/models/reward_model/unload"),
        ("POST", "/v2/repository/models/reward_model/load"),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/systemsharedmemory/region/x/register"),
        ("POST", "/v2/logging"),
        ("PUT", "/v2/models/reward_model/infer"),
        ("POST", "/v2/models/reward_model/generate"),
    ],
)
def test_tritons_control_routes_are_not_reachable(cli_servers, method, path):
    conn = http.client.HTTPConnection("127.0.0.1", cli_servers.reward_port, timeout=10)
    try:
        conn.request(method, path, body=b"{}", headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        status, error = response.status, json.loads(response.read())["error"]
    finally:
        conn.close()
    assert status == 405 and f"{method} {path} is not served here" in error
    assert reward_infer(cli_servers.reward_port).shape == (2, 1)  # the model is still loaded
