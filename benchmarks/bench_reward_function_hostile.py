"""Good clients' latency on a served reward function, with and without hostile clients beside them.

The server is ``openaligner serve-reward reward.function=<this file>:score`` (a real Triton behind
its HTTP front, default settings but ``reward.timeout_s``, ``threads=1``), started once as a
subprocess. ``score`` is the length of each response, unless a row's metadata says ``do``:
``raise`` (ValueError), ``hang`` (sleeps an hour: the call times out) or ``exit`` (``os._exit(7)``:
the worker dies).

Good clients: ``--good`` closed-loop threads (one keep-alive ``http.client.HTTPConnection`` each)
sending plain KServe v2 JSON, as curl or ``tritonclient`` do — one conversation per request, no
resend —, each answer checked (HTTP 200 and the reward ``len(response)``; anything else counts as
an error). Hostile clients: ``--hostile`` threads, client *i* sending the ``--kinds`` (``raise``,
``hang``, ``exit``) in turn starting at kind *i*, the next request as soon as the last was answered (each must
be answered 400 naming the function's error). The two conditions are measured side by side:
``--rounds`` rounds, each ``--seconds`` of good clients alone ("quiet") then as long with the
hostile ones ("hostile"); reported per condition: good requests answered, errors, p50/p99/max
latency (medians over the rounds, and every round), the p99 of all rounds' latencies pooled, the
hostile answers by status, and the ratio of the hostile condition's p99 to the quiet one's (medians
over the rounds).

Prints one JSON object. Usage:
``python benchmarks/bench_reward_function_hostile.py [--seconds 15] [--rounds 2] [--good 8]
[--hostile 4] [--timeout-s 5] [--kinds raise hang exit]``. Run it with another ``PYTHONPATH`` to
measure another version (the server inherits the environment).
"""

from __future__ import annotations

import os
import time
from typing import Any

HANG_S = 3600.0


def score(prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """The served function: ``len(response)``, or what a row's ``do`` asks for."""
    todo = {m.get("do") for m in metadata}
    if "raise" in todo:
        raise ValueError("asked to fail")
    if "hang" in todo:
        time.sleep(HANG_S)
    if "exit" in todo:
        os._exit(7)
    return [float(len(r)) for r in responses]


# Everything below runs in the benchmark process only (the server's workers import this file).
if __name__ == "__main__":
    import argparse
    import http.client
    import json
    import platform
    import re
    import signal
    import socket
    import statistics
    import subprocess
    import sys
    import threading
    from importlib import metadata as package_metadata
    from pathlib import Path

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def request_body(response: str, do: str | None) -> bytes:
        conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]
        inputs = [
            {"name": "messages", "datatype": "BYTES", "shape": [1, 1], "data": [json.dumps(conversation)]},
            {"name": "metadata", "datatype": "BYTES", "shape": [1, 1], "data": [json.dumps({"do": do})]},
        ]
        return json.dumps({"inputs": inputs}).encode()

    def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, Any]:
        conn.request("POST", "/v2/models/reward_model/infer", body=body)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())

    def percentile(ordered: list[float], q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    class Phase:
        """One condition of one round: good latencies, good errors, hostile answers."""

        def __init__(self) -> None:
            self.latencies: list[float] = []
            self.errors: list[str] = []
            self.hostile: dict[str, int] = {}
            self.lock = threading.Lock()

        def summary(self) -> dict[str, Any]:
            ordered = sorted(self.latencies)
            return {
                "good_answered": len(ordered),
                "good_errors": len(self.errors),
                "first_errors": self.errors[:3],
                "p50_s": round(statistics.median(ordered), 4) if ordered else None,
                "p99_s": round(percentile(ordered, 0.99), 4),
                "max_s": round(ordered[-1], 4) if ordered else None,
                "hostile_answers": dict(sorted(self.hostile.items())),
            }

    def good_client(port: int, index: int, phase: Phase, stop: threading.Event) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        n = 0
        while not stop.is_set():
            response = "x" * (1 + (index * 7 + n) % 40)
            n += 1
            t0 = time.perf_counter()
            try:
                status, answer = post(conn, request_body(response, None))
            except (OSError, http.client.HTTPException, ValueError) as e:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                status, answer = -1, {"error": f"{type(e).__name__}: {e}"}
            elapsed = time.perf_counter() - t0
            with phase.lock:
                if status == 200 and answer["outputs"][0]["data"] == [float(len(response))]:
                    phase.latencies.append(elapsed)
                else:
                    phase.errors.append(f"{status}: {str(answer)[:300]}")
        conn.close()

    def hostile_client(port: int, index: int, kinds: list[str], phase: Phase, stop: threading.Event) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        n = index
        while not stop.is_set():
            kind = kinds[n % len(kinds)]
            n += 1
            try:
                status, _ = post(conn, request_body("bad", kind))
            except (OSError, http.client.HTTPException, ValueError):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                status = -1
            with phase.lock:
                key = f"{kind} {status}"
                phase.hostile[key] = phase.hostile.get(key, 0) + 1
        conn.close()

    def measure(port: int, seconds: float, good: int, hostile: int, kinds: list[str]) -> Phase:
        phase, stop = Phase(), threading.Event()
        threads = [threading.Thread(target=good_client, args=(port, i, phase, stop)) for i in range(good)]
        threads += [
            threading.Thread(target=hostile_client, args=(port, i, kinds, phase, stop))
            for i in range(hostile)
        ]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:  # a hostile client may still wait for its hanging call (≤ the timeout)
            t.join()
        return phase

    def start_server(port: int, timeout_s: float) -> subprocess.Popen[str]:
        command = [
            sys.executable,
            "-m",
            "openaligner",
            "serve-reward",
            f"reward.function={Path(__file__).resolve()}:score",
            f"server.port={port}",
            f"reward.timeout_s={timeout_s:g}",
            "threads=1",
            "log_level=WARNING",
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert server.stdout is not None
        for line in server.stdout:
            if re.search(r"ready at http://", line):
                break
        else:
            raise RuntimeError(f"the server exited ({server.wait()}) before it was ready")
        threading.Thread(target=lambda: [None for _ in server.stdout or []], daemon=True).start()
        return server

    def main() -> None:
        parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
        parser.add_argument("--seconds", type=float, default=15.0)
        parser.add_argument("--rounds", type=int, default=2)
        parser.add_argument("--good", type=int, default=8)
        parser.add_argument("--hostile", type=int, default=4)
        parser.add_argument("--timeout-s", type=float, default=5.0)
        parser.add_argument(
            "--kinds", nargs="+", choices=["raise", "hang", "exit"], default=["raise", "hang", "exit"]
        )
        args = parser.parse_args()
        port = free_port()
        server = start_server(port, args.timeout_s)
        rounds = []
        pooled: dict[str, list[float]] = {"quiet": [], "hostile": []}
        try:
            measure(port, 1.0, args.good, 0, args.kinds)  # warm-up
            for _ in range(args.rounds):
                quiet = measure(port, args.seconds, args.good, 0, args.kinds)
                hostile = measure(port, args.seconds, args.good, args.hostile, args.kinds)
                rounds.append({"quiet": quiet.summary(), "hostile": hostile.summary()})
                pooled["quiet"] += quiet.latencies
                pooled["hostile"] += hostile.latencies
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)

        def median_of(condition: str, key: str) -> float:
            return statistics.median(r[condition][key] for r in rounds)

        result = {
            "settings": vars(args),
            "quiet_p50_s": median_of("quiet", "p50_s"),
            "quiet_p99_s": median_of("quiet", "p99_s"),
            "hostile_p50_s": median_of("hostile", "p50_s"),
            "hostile_p99_s": median_of("hostile", "p99_s"),
            "pooled_p99_s": {c: round(percentile(sorted(v), 0.99), 4) for c, v in pooled.items()},
            "hostile_max_s": max(r["hostile"]["max_s"] or 0.0 for r in rounds),
            "good_errors": sum(r[c]["good_errors"] for r in rounds for c in ("quiet", "hostile")),
            "rounds": rounds,
            "python": platform.python_version(),
            "nvidia-pytriton": package_metadata.version("nvidia-pytriton"),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
        }
        result["p99_ratio_hostile_to_quiet"] = round(result["hostile_p99_s"] / result["quiet_p99_s"], 2)
        print(json.dumps(result, indent=1))

    main()
