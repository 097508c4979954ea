"""serve-tinker loads base models from several threads (the HTTP threads of base-model samplers
and checkpoint hosts, the worker's ``create_model``): the loads must not run at once, because
transformers' loading is not thread-safe — two threads loading a model whose head is tied to its
embedding at the same time leave the head on the meta device (found with Gemma 3 270M, whose
base-model ``asample`` calls, sent together by a client, all failed).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from openaligner.algorithms.tinker_losses import tinker_loss
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.servers.tinker.service import TinkerService

CALLERS = 4


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tied")
    tok = build_char_tokenizer()
    model = build_tiny_causal_lm(
        "gpt2", TinySize(vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=2)
    )
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # the tied head
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


def test_base_model_samplers_called_at_once_load_the_model_once_and_all_sample(
    tied_dir: Path, tmp_path: Path
) -> None:
    service = TinkerService({"tied": tied_dir}, tmp_path / "ckpt", tinker_loss)
    try:
        session = service.create_session({})["session_id"]
        sampler = service.create_sampling_session({"session_id": session, "base_model": "tied"})[
            "sampling_session_id"
        ]
        body = {
            "sampling_session_id": sampler,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1, "stop": []},
        }
        start = threading.Barrier(CALLERS)
        failures: list[BaseException] = []
        futures: list[Any] = []

        def call() -> None:
            start.wait()  # the calls meet the model unloaded together, as a client's batch does
            try:
                futures.append(service.asample(body, lambda seqs, plp: seqs))
            except BaseException as e:  # what a caller got is the finding
                failures.append(e)

        threads = [threading.Thread(target=call) for _ in range(CALLERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        results = [service.jobs.get(f["request_id"]).result(timeout=60) for f in futures]  # type: ignore[union-attr]
        assert len(results) == CALLERS and all(len(seqs) == 1 for seqs in results)
        # one seed, one model: the same sample for every caller
        assert len({tuple(seqs[0].tokens.tolist()) for seqs in results}) == 1
        (plain,) = service._plain.values()
        assert not any(p.is_meta for p in plain.parameters())
        assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
        assert torch.isfinite(plain.get_output_embeddings().weight).all()
    finally:
        service.close()
