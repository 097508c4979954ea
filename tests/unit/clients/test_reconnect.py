"""Riding out a server restart (``reconnect_grace_s``) against a scripted KServe-v2 HTTP server that
can stop listening, come back on the same port, or drop a connection while staying up.

What is resent: idempotent requests after any lost connection; a non-idempotent one only when the
server cannot have kept its effect (refused before sending, or gone right after the drop).
"""

import contextlib
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from openaligner.clients.base import TritonHTTPClient
from openaligner.clients.critic import RemoteCriticConfig
from openaligner.clients.errors import ClientClosedError, ServerTimeoutError, ServerUnavailableError
from openaligner.clients.reward import RemoteRMConfig
from openaligner.config import ConfigError, load_config

MODEL = "critic_train"


class RestartableServer:
    """Answers readiness and ``MODEL`` requests; ``mode`` decides what a request gets:

    ``ok`` an answer; ``drop`` the connection closed unanswered, the server staying up
    (``drop_once``: then ``ok``); ``crash`` the server stops listening, then the connection is
    closed unanswered (a killed process); ``crash_slowly`` the same, but the server stops
    listening 0.3 s after the drop (a process still dying).
    """

    def __init__(self, port: int = 0) -> None:
        self.received: list[int] = []  # the `x` of every request that reached the server
        self.connections: set[socket.socket] = set()
        self.mode = "ok"
        self._start(port)

    def _start(self, port: int) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                outer.connections.add(self.connection)

            def finish(self):
                outer.connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def _send(self, status, body=b""):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200 if self.path in ("/v2/health/ready", f"/v2/models/{MODEL}/ready") else 400)

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                size = int(self.headers.get("Inference-Header-Content-Length", len(body)))
                outer.received.append(int(np.frombuffer(body[size:], np.int64)[0]))
                if outer.mode == "ok":
                    outputs = [{"name": "y", "datatype": "INT64", "shape": [1], "data": [outer.received[-1]]}]
                    self._send(200, json.dumps({"outputs": outputs}).encode())
                    return
                if outer.mode == "crash":
                    outer.stop()  # nothing listens any more when the client sees the drop
                if outer.mode == "crash_slowly":  # still listening for a moment after the drop
                    threading.Timer(0.3, outer.stop).start()
                if outer.mode == "drop_once":
                    outer.mode = "ok"
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._loop = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05})
        self._loop.daemon = True
        self._loop.start()

    def stop(self) -> None:
        """Stop at once, as a killed process does: nothing listens (connections are refused) and the
        open connections are closed. The serving loop ends in the background."""
        if self.httpd.socket.fileno() < 0:
            return  # already stopped
        self.httpd.socket.shutdown(socket.SHUT_RDWR)  # unlike close(), effective while polled
        self.httpd.socket.close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        threading.Thread(target=self.httpd.shutdown, daemon=True).start()

    def restart(self, after_s: float = 0.0) -> None:
        """Listen again on the same port after ``after_s`` (in the background), answering normally."""

        def again() -> None:
            time.sleep(after_s)
            self.mode = "ok"
            self._start(self.port)

        threading.Thread(target=again, daemon=True).start()


@pytest.fixture()
def server():
    s = RestartableServer()
    yield s
    s.stop()


def client_for(port: int, grace: float) -> TritonHTTPClient:
    return TritonHTTPClient(
        "127.0.0.1",
        port,
        server_name="critic server",
        init_timeout_s=2.0,
        request_timeout_s=5.0,
        max_workers=1,
        reconnect_grace_s=grace,
    )


def send(client: TritonHTTPClient, x: int, idempotent: bool = True) -> int:
    future = client.submit(
        MODEL, {"x": np.array([x], np.int64)}, lambda o: int(o["y"][0]), idempotent=idempotent
    )
    return future.result(timeout=30)


def test_without_grace_a_gone_server_fails_at_once_naming_host_port_and_model(server):
    with client_for(server.port, grace=0) as client:
        assert send(client, 1) == 1
        server.stop()
        with pytest.raises(ServerUnavailableError) as info:
            send(client, 2)
    message = str(info.value)
    assert f"127.0.0.1:{server.port}" in message and f"'{MODEL}'" in message
    assert "reconnect_grace_s=0" in message and "connection refused" in message


def test_idempotent_request_waits_for_the_restart_and_is_resent(server, caplog):
    with client_for(server.port, grace=20) as client, caplog.at_level(logging.INFO):
        assert send(client, 1) == 1
        server.mode = "crash"
        server.restart(after_s=0.5)
        assert send(client, 2) == 2
    assert server.received == [1, 2, 2]  # the lost attempt, then the resend to the restarted server
    assert "waiting up to reconnect_grace_s=20 s" in caplog.text and "answers again" in caplog.text


def test_server_that_stays_away_fails_after_the_grace_naming_what_to_do(server):
    with client_for(server.port, grace=0.5) as client:
        assert send(client, 1) == 1
        server.stop()
        with pytest.raises(ServerTimeoutError) as info:
            send(client, 2)
    message = str(info.value)
    assert f"127.0.0.1:{server.port}" in message and f"'{MODEL}'" in message
    assert "did not answer again within reconnect_grace_s=0.5 s" in message
    assert "Restart the server, or raise reconnect_grace_s" in message


def test_train_refused_before_sending_is_sent_once_to_the_restarted_server(server):
    with client_for(server.port, grace=20) as client:
        assert send(client, 1, idempotent=False) == 1
        server.stop()
        time.sleep(0.2)  # the next request finds nothing listening
        server.restart(after_s=0.5)
        assert send(client, 2, idempotent=False) == 2
    assert server.received == [1, 2]


def test_train_lost_with_its_server_is_resent_once_it_is_back(server):
    with client_for(server.port, grace=20) as client:
        server.mode = "crash"  # the process dies with the request: its effect died with it
        server.restart(after_s=0.5)
        assert send(client, 7, idempotent=False) == 7
    assert server.received == [7, 7]


def test_train_lost_with_a_server_that_stops_listening_only_later_is_resent(server):
    with client_for(server.port, grace=20) as client:
        server.mode = "crash_slowly"
        server.restart(after_s=1.0)
        assert send(client, 8, idempotent=False) == 8
    assert server.received == [8, 8]


def test_train_dropped_by_a_server_still_up_is_not_resent(server):
    with client_for(server.port, grace=20) as client:
        server.mode = "drop"
        with pytest.raises(ServerUnavailableError) as info:
            send(client, 3, idempotent=False)
        assert server.received == [3]  # it may have trained: never a second time
        assert "is still up: it may have run the request already" in str(info.value)
        assert "not resent" in str(info.value)
        # an idempotent request in the same situation is simply sent again
        server.mode = "ok"
        assert send(client, 4) == 4


def test_idempotent_request_dropped_by_a_server_still_up_is_resent(server):
    with client_for(server.port, grace=20) as client:
        server.mode = "drop_once"
        assert send(client, 5) == 5
    assert server.received == [5, 5]


def test_close_ends_a_wait_for_the_server(server):
    client = client_for(server.port, grace=600)
    assert send(client, 1) == 1
    server.stop()
    future = client.submit(MODEL, {"x": np.array([2], np.int64)}, lambda o: int(o["y"][0]))
    wait_until = time.monotonic() + 10
    while client._outage is None and time.monotonic() < wait_until:  # the worker is now waiting
        time.sleep(0.01)
    client.close(timeout_s=0.5)
    with pytest.raises(ClientClosedError):
        future.result(timeout=5)
    for worker in client._workers:  # the wait ends with the client, not with the grace
        worker.join(timeout=10)
        assert not worker.is_alive()


@pytest.mark.parametrize("schema", [RemoteCriticConfig, RemoteRMConfig])
def test_grace_is_a_config_key_that_must_not_be_negative(schema):
    assert load_config(schema, None, []).reconnect_grace_s == 0.0
    assert load_config(schema, None, ["reconnect_grace_s=30"]).reconnect_grace_s == 30.0
    with pytest.raises(ConfigError, match="reconnect_grace_s must be >= 0"):
        load_config(schema, None, ["reconnect_grace_s=-1"])
