"""The Tinker SDK's side of benchmarks/bench_tinker.py, run by the SDK's virtualenv (``make
tinker-setup``): drives a running ``serve-tinker`` with the unmodified ``tinker`` SDK and prints
one ``RESULT {...}`` JSON line of wall-clock seconds per call.

    python tinker_bench_client.py BASE_URL MODEL SPEC_JSON BODY_OUT
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import tinker
from tinker import types
from tinker.proto import request_conv


def main() -> None:
    url, model, spec_json, body_out = sys.argv[1:5]
    spec = json.loads(spec_json)
    rng = random.Random(0)
    prompt_len, response_len = spec["prompt_tokens"], spec["response_tokens"]
    width = prompt_len + response_len
    batch = []
    for _ in range(spec["datums"]):
        ids = [rng.randrange(3, spec["vocab"]) for _ in range(width + 1)]
        weights = [0.0] * (prompt_len - 1) + [1.0] * (width - prompt_len + 1)
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    # the body the SDK sends for this batch, for the server-side decode timing
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=batch, loss_fn="cross_entropy"),
        model_id="m",
        seq_id=1,
    )
    Path(body_out).write_bytes(request_conv.forward_backward_request_to_proto(request).SerializeToString())

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    client = service.create_lora_training_client(base_model=model, rank=spec["rank"], seed=0).result()
    adam = types.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
    step_s, losses = [], []
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        fb = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(adam)
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
        step_s.append(time.perf_counter() - started)

    # the floor of one call: a forward of one token (nothing to compute, everything else paid)
    tiny = [types.Datum(model_input=types.ModelInput.from_ints([5]), loss_fn_inputs={"target_tokens": [6], "weights": [1.0]})]
    call_s = []
    for _ in range(spec["calls"]):
        started = time.perf_counter()
        client.forward(tiny, "cross_entropy").result()
        call_s.append(time.perf_counter() - started)

    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=response_len, temperature=1.0, stop=[])
    prompts = [types.ModelInput.from_ints([rng.randrange(3, spec["vocab"]) for _ in range(prompt_len)]) for _ in range(spec["samples"])]
    sample_s, sample_tokens = [], []
    for _ in range(spec["sample_repeats"]):
        started = time.perf_counter()
        futures = [sampler.sample(p, num_samples=1, sampling_params=params) for p in prompts]  # as the cookbook: all at once
        results = [f.result() for f in futures]
        sample_s.append(time.perf_counter() - started)
        sample_tokens.append(sum(len(r.sequences[0].tokens) for r in results))
    service.close("success")
    print(
        "RESULT "
        + json.dumps(
            {
                "step_s": step_s,
                "call_s": call_s,
                "sample_s": sample_s,
                "sample_tokens": sample_tokens,
                "losses": losses,
                "tinker_version": tinker.__version__,
                "median_step_s": statistics.median(step_s[1:]),
            }
        )
    )


if __name__ == "__main__":
    main()
