"""What runs inside a reward function's worker process: loading ``module:callable`` and answering
calls. Standard library only, so that a worker starts in a fraction of a second (it imports no
torch); :class:`~openaligner.servers.reward_function.FunctionRunner` starts it
(``python -m openaligner.servers.function_worker FD``, FD its end of a socket pair) and feeds it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


class RewardFunctionError(RuntimeError):
    """The reward function failed on a call: it raised, timed out, died or returned a wrong value."""


class RewardFunctionLoadError(ValueError):
    """``reward.function`` cannot be loaded: bad form, import error, not callable."""


def load_function(spec: str) -> tuple[Callable[..., Any], bool]:
    """``module:callable`` or ``path/to/file.py:callable`` → ``(fn, takes_metadata)``.

    Raises:
        RewardFunctionLoadError: naming the spec and what went wrong.
    """
    module_name, attr = split_spec(spec)
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise RewardFunctionLoadError(f"reward.function={spec!r}: {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except RewardFunctionLoadError:
        raise
    except Exception as e:  # the user's module: anything may go wrong while importing it
        raise RewardFunctionLoadError(
            f"reward.function={spec!r}: importing {module_name!r} failed ({type(e).__name__}: {e})"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardFunctionLoadError(
            f"reward.function={spec!r}: {module_name!r} has no callable {attr!r}"
            + (f" (it is a {type(fn).__name__})" if fn is not None else "")
        )
    return fn, _takes_metadata(fn)


def split_spec(spec: str) -> tuple[str, str]:
    """``module:callable`` → ``(module, callable)``.

    Raises:
        RewardFunctionLoadError: the spec has another form.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionLoadError(
            f"reward.function={spec!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    return module_name, attr


def _takes_metadata(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a third positional argument (``metadata``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in kinds]
    return len(positional) >= 3


def check_scores(value: Any, rows: int, name: str) -> list[float]:
    """The function's answer as ``rows`` finite floats.

    Raises:
        RewardFunctionError: naming what it returned and what was expected.
    """
    if hasattr(value, "tolist") and not isinstance(value, Sequence):  # a tensor or an array
        value = value.tolist()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise RewardFunctionError(
            f"{name} returned {type(value).__name__}; expected a list of {rows} numbers, one per response"
        )
    if len(value) != rows:
        raise RewardFunctionError(f"{name} returned {len(value)} scores for {rows} responses")
    scores = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int | float):
            kind = type(v).__name__
            raise RewardFunctionError(f"{name} returned {v!r} ({kind}) for row {i}; expected a number")
        if not math.isfinite(float(v)):
            raise RewardFunctionError(f"{name} returned {v} for row {i}; expected a finite number")
        scores.append(float(v))
    return scores


def worker_main(spec: str, conn: Connection) -> None:
    """The worker process: load the function, then answer ``(prompts, responses, metadata)``
    calls with ``("ok", scores)`` or ``("error", message)`` until the pipe closes (the server
    closed it, or died). Ctrl-C in the server's terminal reaches the whole process group: the worker
    ignores it and is stopped by the server instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn, takes_metadata = load_function(spec)
    except RewardFunctionLoadError as e:
        conn.send(("load_error", str(e)))
        return
    conn.send(("ready", takes_metadata))
    while True:
        try:
            prompts, responses, metadata = conn.recv()
        except (EOFError, OSError):
            return
        try:
            value = fn(prompts, responses, metadata) if takes_metadata else fn(prompts, responses)
            conn.send(("ok", check_scores(value, len(prompts), spec)))
        except RewardFunctionError as e:
            conn.send(("error", str(e)))
        except BaseException as e:  # the user's code: report whatever it raised, keep serving
            conn.send(("error", f"{spec} raised {type(e).__name__}: {e}"))


def main(argv: Sequence[str]) -> None:
    """``python -m openaligner.servers.function_worker FD``: receive ``(spec, sys.path)`` on the
    connection FD, then serve as :func:`worker_main`."""
    conn = Connection(int(argv[0]))
    spec, path = conn.recv()
    sys.path[:] = path
    worker_main(spec, conn)


if __name__ == "__main__":
    main(sys.argv[1:])
