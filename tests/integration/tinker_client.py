"""A Tinker SDK client for the serve-tinker tests, run by the Tinker venv's Python (``make
tinker-setup``): it imports only the real ``tinker`` SDK, drives the server as a user's script
would, and prints one JSON line (``RESULT {...}``) for the test to judge.

    python tinker_client.py COMMAND BASE_URL MODEL [ARG]

Commands: ``sl`` (a supervised loop), ``save`` (train, save_state, train on: the uninterrupted
run), ``resume`` (load that state with its optimizer and train the same steps), ``sample`` (the
sampling contract), ``engine`` (greedy samples before and after training, and of the old sampler
again: the vllm engine's test), ``errors`` (refusals, each naming what was wrong).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import tinker
from tinker import types

API_KEY = "tml-serve-tinker-tests"
TEXTS = ["User: 2+2?\n\nAssistant: 4\n\n", "User: 3+5?\n\nAssistant: 8\n\n", "User: 1+6?\n\nAssistant: 7\n\n"]
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def datums(tokenizer: Any) -> list[types.Datum]:
    """The supervised batch: every text, the answer part weighted (the prompt's weights 0)."""
    out = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt = len(tokenizer.encode(text.split("Assistant:")[0], add_special_tokens=False))
        weights = [0.0 if i < prompt - 1 else 1.0 for i in range(len(ids) - 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


def train_steps(client: Any, batch: list[types.Datum], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(ADAM).result()
        losses.append(fb.metrics["loss:sum"])
    return losses


def service(url: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=API_KEY)


def cmd_sl(url: str, model: str) -> dict[str, Any]:
    sc = service(url)
    tc = sc.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    batch = datums(tc.get_tokenizer())
    start = tc.save_state("start").result().path
    before = tc.forward(batch, "cross_entropy").result()
    # two calls before one step: gradients add up (the losses are sums)
    first = tc.forward_backward(batch[:1], "cross_entropy").result()
    rest = tc.forward_backward(batch[1:], "cross_entropy").result()
    tc.optim_step(ADAM).result()
    losses = [first.metrics["loss:sum"] + rest.metrics["loss:sum"], *train_steps(tc, batch, 6)]
    nll = [
        -sum(
            lp * w
            for lp, w in zip(out["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist(), strict=True)
        )
        for out, d in zip(before.loss_fn_outputs, batch, strict=True)
    ]
    info = tc.get_info()
    tc.load_state(start).result()  # model-addressed load, weights only: back to the start
    reloaded = tc.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    sc.close("success")
    return {
        "losses": losses,
        "reloaded_loss": reloaded,
        "forward_loss": before.metrics["loss:sum"],
        "forward_nll_sum": sum(nll),
        "output_keys": sorted(before.loss_fn_outputs[0]),
        "model_name": info.model_data.model_name,
        "model_id": info.model_id,
    }


def cmd_save(url: str, model: str) -> dict[str, Any]:
    sc = service(url)
    tc = sc.create_lora_training_client(base_model=model, rank=8, seed=1).result()
    batch = datums(tc.get_tokenizer())
    train_steps(tc, batch, 2)
    path = tc.save_state("resume-point").result().path
    continued = train_steps(tc, batch, 3)
    sc.close("success")
    return {"path": path, "continued": continued}


def cmd_resume(url: str, path: str) -> dict[str, Any]:
    sc = service(url)
    tc = sc.create_training_client_from_state_with_optimizer(path).result()
    batch = datums(tc.get_tokenizer())
    continued = train_steps(tc, batch, 3)
    sc.close("success")
    return {"continued": continued, "model_id": tc.get_info().model_id}


def cmd_sample(url: str, model: str) -> dict[str, Any]:
    sc = service(url)
    tc = sc.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("User: 2+2?\n\nAssistant:", add_special_tokens=False))
    letters = list("ETAOINSHRDLU0123")
    by_string = sampler.sample(
        prompt, 4, types.SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop=letters)
    ).result()
    again = sampler.sample(
        prompt, 4, types.SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop=letters)
    ).result()
    stop_ids = [tok.encode(c, add_special_tokens=False)[0] for c in letters]
    by_id = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=40, seed=4, stop=stop_ids)).result()
    short = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2, seed=5, stop=[])).result()
    scored = sampler.compute_logprobs(prompt).result()
    forward = tc.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(prompt.to_ints()[:-1]),
                loss_fn_inputs={
                    "target_tokens": prompt.to_ints()[1:],
                    "weights": [1.0] * (prompt.length - 1),
                },
            )
        ],
        "cross_entropy",
    ).result()

    def seqs(resp: Any) -> list[dict[str, Any]]:
        return [
            {
                "tokens": list(s.tokens),
                "text": tok.decode(list(s.tokens)),
                "logprobs": list(s.logprobs),
                "stop_reason": s.stop_reason,
                "sequence_id": s.sequence_id,
            }
            for s in resp.sequences
        ]

    sc.close("success")
    return {
        "letters": letters,
        "stop_ids": stop_ids,
        "by_string": seqs(by_string),
        "again": seqs(again),
        "by_id": seqs(by_id),
        "short": seqs(short),
        "prompt_logprobs": scored,
        "forward_logprobs": forward.loss_fn_outputs[0]["logprobs"].tolist(),
    }


def cmd_engine(url: str, model: str) -> dict[str, Any]:
    """Greedy samples of a snapshot sampler, then training toward a target, a saved sampler path's
    samples (greedy, seeded, prompt log-probs) and the first sampler's again."""
    sc = service(url)
    tc = sc.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    prompt_ids = tok.encode("User: 2+2?\n\nAssistant:", add_special_tokens=False)
    prompt = types.ModelInput.from_ints(prompt_ids)
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    before_path = tc.save_weights_for_sampler("before").result().path
    old = tc.save_weights_and_get_sampling_client().result()
    first = old.sample(prompt, 1, greedy).result()
    target = tok.encode(" 4444 4444", add_special_tokens=False)
    ids = prompt_ids + target
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * (len(prompt_ids) - 1) + [1.0] * len(target),
        },
    )
    for _ in range(4):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    after_path = tc.save_weights_for_sampler("after").result().path
    new = sc.create_sampling_client(model_path=after_path).result()
    trained = new.sample(prompt, 2, greedy).result()
    scored = new.compute_logprobs(prompt).result()
    seeded = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    draws = [new.sample(prompt, 3, seeded).result() for _ in range(2)]
    old_again = old.sample(prompt, 1, greedy).result()

    def seqs(resp: Any) -> list[dict[str, Any]]:
        return [
            {"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason}
            for s in resp.sequences
        ]

    sc.close("success")
    return {
        "model_id": tc.get_info().model_id,
        "prompt": prompt_ids,
        "before_path": before_path,
        "after_path": after_path,
        "first": seqs(first),
        "trained": seqs(trained),
        "prompt_logprobs": scored,
        "draws": [seqs(d) for d in draws],
        "old_again": seqs(old_again),
    }


def failure(call: Any) -> str:
    """The message of the exception ``call()`` raises (it must raise)."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the call succeeded but should have been refused")


def cmd_errors(url: str, model: str) -> dict[str, Any]:
    sc = service(url)
    out: dict[str, Any] = {}
    out["unknown_base"] = failure(
        lambda: sc.create_lora_training_client(base_model="no/such-model", rank=4).result()
    )
    out["big_rank"] = failure(lambda: sc.create_lora_training_client(base_model=model, rank=100000).result())
    tc = sc.create_lora_training_client(base_model=model, rank=4).result()
    good = datums(tc.get_tokenizer())[0]
    n = good.model_input.length
    oov = types.Datum(
        model_input=types.ModelInput.from_ints([5] * (n - 1) + [10**6]), loss_fn_inputs=good.loss_fn_inputs
    )
    out["oov"] = failure(lambda: tc.forward_backward([oov], "cross_entropy").result())
    short_weights = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={"target_tokens": good.loss_fn_inputs["target_tokens"], "weights": [1.0] * (n - 2)},
    )
    out["shape"] = failure(lambda: tc.forward_backward([short_weights], "cross_entropy").result())
    out["loss"] = failure(lambda: tc.forward_backward([good], "stable_reinforce").result())
    out["sample_strings"] = failure(
        lambda: (
            tc.save_weights_and_get_sampling_client()
            .result()
            .sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=2))
            .result()
        )
    )
    # the model still trains after every refusal
    out["after"] = tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"]
    sc.close("success")
    return out


COMMANDS = {
    "sl": cmd_sl,
    "save": cmd_save,
    "resume": cmd_resume,
    "sample": cmd_sample,
    "engine": cmd_engine,
    "errors": cmd_errors,
}

if __name__ == "__main__":
    command, url, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    result = COMMANDS[command](url, arg)
    print("RESULT " + json.dumps(result), flush=True)
