"""The Tinker SDK's side of benchmarks/bench_tinker.py, run by the SDK's virtualenv (``make
tinker-setup``): drives a running ``serve-tinker`` with the unmodified ``tinker`` SDK. Prints
``READY``, then answers each command read from stdin (``train``, ``call``, ``sample``; anything
else ends it) with one JSON line holding its wall-clock seconds ``s``.

    python tinker_bench_client.py BASE_URL MODEL SPEC_JSON BODY_OUT
"""

from __future__ import annotations

import json
import random
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
    tiny = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5]),
            loss_fn_inputs={"target_tokens": [6], "weights": [1.0]},
        )
    ]
    params = types.SamplingParams(max_tokens=response_len, temperature=1.0, stop=[])
    prompts = [
        types.ModelInput.from_ints([rng.randrange(3, spec["vocab"]) for _ in range(prompt_len)])
        for _ in range(spec["samples"])
    ]
    sampler = None
    print("READY", flush=True)
    # one measurement per command, so that the caller can interleave them with its own
    for line in sys.stdin:
        command = line.strip()
        started = time.perf_counter()
        if command == "train":
            fb = client.forward_backward(batch, "cross_entropy")
            opt = client.optim_step(adam)
            answer = {"loss": fb.result().metrics["loss:sum"]}
            opt.result()
        elif command == "call":  # the floor of one call: a forward of one token
            client.forward(tiny, "cross_entropy").result()
            answer = {}
        elif command == "sample":  # all prompts at once, num_samples=1 each, as the cookbook does
            if sampler is None:
                sampler = client.save_weights_and_get_sampling_client().result()
                started = time.perf_counter()
            futures = [sampler.sample(p, num_samples=1, sampling_params=params) for p in prompts]
            answer = {"tokens": sum(len(f.result().sequences[0].tokens) for f in futures)}
        else:
            break
        answer["s"] = time.perf_counter() - started
        print(json.dumps(answer), flush=True)
    service.close("success")
    print(json.dumps({"tinker_version": tinker.__version__}), flush=True)


if __name__ == "__main__":
    main()
