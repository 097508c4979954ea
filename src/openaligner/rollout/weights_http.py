"""Weights by HTTP: a whole ``model.safetensors`` streamed to an engine of ``openaligner
serve-rollout`` that is not on this machine (or ``rollout.vllm.weight_transfer=http``), as
``PUT /weights`` with its size and the link's lease; the engine checks it before it keeps it.

Must not write the file (``weights_file``) nor decide when weights go out (the engine's push).
"""

from __future__ import annotations

import http.client
from pathlib import Path

from openaligner.rollout.engine import RolloutEngineError
from openaligner.rollout.vllm_config import check_engine_url
from openaligner.rollout.vllm_link import LEASE_HEADER, EngineLink


def upload(link: EngineLink, path: Path) -> None:
    """``PUT /weights``: ``path`` streamed with its size; the engine refuses a body of another
    size."""
    size = path.stat().st_size
    host, port = check_engine_url(link.url, "rollout.vllm.url")
    conn = http.client.HTTPConnection(host, port, timeout=link.request_timeout_s)
    try:
        with path.open("rb") as f:
            headers = {
                "Content-Length": str(size),
                "Content-Type": "application/octet-stream",
                LEASE_HEADER: link.lease,
            }
            conn.request("PUT", "/weights", body=f, headers=headers)
            reply = conn.getresponse()
            payload = reply.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        raise RolloutEngineError(
            f"the vllm rollout engine at {link.url} did not take the weights (PUT /weights, {size} "
            f"bytes): {type(e).__name__}: {e}"
        ) from None
    finally:
        conn.close()
    if reply.status != 200:
        raise RolloutEngineError(f"the vllm rollout engine at {link.url} refused PUT /weights: {payload}")
