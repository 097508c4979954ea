"""PPO with a served critic, written against the Tinker API (the ``tinker`` SDK only).

The policy and the critic are two training clients of one ``openaligner serve-tinker``: the
critic is created with ``user_metadata={"model_role": "critic"}`` (a value head on the same base
model, trained with the clipped value loss of openaligner's critic server), its ``forward`` gives
the values GAE needs, and its ``forward_backward(..., "ppo")`` takes ``values`` / ``returns`` /
``mask``. The task is a toy one a tiny model can show: reward = the share of digits in the
response.

    python examples/tinker_ppo_critic.py --base-url http://127.0.0.1:8000 --model /path/to/hf-dir

(``TINKER_API_KEY=tml-<server.token>`` when the server has a token.) Prints one JSON line per
iteration and, last, ``RESULT {...}``: the mean rewards, and each iteration's critic loss on its
batch before and after the critic's update.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import tinker
from tinker import types

PROMPT = "Write digits: "
GAMMA, LAMBDA = 1.0, 0.95


def gae(rewards: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns [T] of one response (``values`` [T]: V of the state before each
    response token; the state after the last token is terminal, value 0)."""
    nxt = np.append(values[1:], 0.0)
    deltas = rewards + GAMMA * nxt - values
    adv = np.zeros_like(values)
    running = 0.0
    for t in range(len(values) - 1, -1, -1):
        running = deltas[t] + GAMMA * LAMBDA * running
        adv[t] = running
    return adv, adv + values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument(
        "--model", required=True, help="base_model: a name the server maps, or a local HF dir"
    )
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()

    service = tinker.ServiceClient(
        base_url=args.base_url, api_key=os.environ.get("TINKER_API_KEY", "tml-local")
    )
    policy = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()
    critic = service.create_lora_training_client(
        base_model=args.model, rank=args.rank, seed=0, user_metadata={"model_role": "critic"}
    ).result()
    tokenizer = policy.get_tokenizer()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    digits = {tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123456789"}
    adam = types.AdamParams(learning_rate=1e-3)
    rewards_by_iteration: list[float] = []
    value_losses: list[tuple[float, float]] = []
    for iteration in range(args.iterations):
        # 1. rollouts from the current policy (its weights frozen in a sampler snapshot)
        sampler = policy.save_weights_and_get_sampling_client().result()
        result = sampler.sample(
            types.ModelInput.from_ints(prompt),
            args.samples,
            types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=iteration, stop=[]),
        ).result()
        seqs = [(list(s.tokens), list(s.logprobs)) for s in result.sequences]
        rewards = [sum(t in digits for t in toks) / len(toks) for toks, _ in seqs]
        # 2. the critic's values of every state, one datum per rollout (position i: state tokens[:i+1])
        inputs = [prompt + toks[:-1] for toks, _ in seqs]
        valued = critic.forward(
            [types.Datum(model_input=types.ModelInput.from_ints(x), loss_fn_inputs={}) for x in inputs], "ppo"
        ).result()
        # 3. GAE on the response positions (the reward at the last token), advantages whitened
        p = len(prompt)
        policy_data, critic_data, advantages = [], [], []
        for (toks, lps), x, out, reward in zip(seqs, inputs, valued.loss_fn_outputs, rewards, strict=True):
            values = np.asarray(out["values"].tolist(), dtype=np.float32)[p - 1 :]
            r = np.zeros(len(toks), dtype=np.float32)
            r[-1] = reward
            adv, ret = gae(r, values)
            advantages.append(adv)
            n = len(x)
            pad = [0.0] * (p - 1)
            mask = pad + [1.0] * len(toks)
            critic_data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(x),
                    loss_fn_inputs={
                        "values": np.asarray(out["values"].tolist(), dtype=np.float32),
                        "returns": np.asarray(pad + ret.tolist(), dtype=np.float32),
                        "mask": np.asarray(mask, dtype=np.float32),
                    },
                )
            )
            policy_data.append((x, (prompt + toks)[1:], pad + lps, n))
        flat = np.concatenate(advantages)
        scale = flat.std() + 1e-6
        datums = [
            types.Datum(
                model_input=types.ModelInput.from_ints(x),
                loss_fn_inputs={
                    "target_tokens": np.asarray(targets, dtype=np.int64),
                    "logprobs": np.asarray(lps, dtype=np.float32),
                    "advantages": np.asarray(
                        [0.0] * (p - 1) + ((a - flat.mean()) / scale).tolist(), dtype=np.float32
                    ),
                },
            )
            for (x, targets, lps, _n), a in zip(policy_data, advantages, strict=True)
        ]
        # 4. one PPO step of the policy and one of the critic (their gradients are sums over tokens)
        ppo = policy.forward_backward(datums, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
        value = critic.forward_backward(critic_data, "ppo", {"value_clip": 0.2})
        before = value.result().metrics["loss:sum"]
        policy_loss = ppo.result().metrics["loss:sum"]
        policy.optim_step(adam).result()
        critic.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        after = critic.forward(critic_data, "ppo").result().metrics["loss:sum"]
        rewards_by_iteration.append(float(np.mean(rewards)))
        value_losses.append((before, after))
        print(
            json.dumps(
                {
                    "iteration": iteration,
                    "reward_mean": rewards_by_iteration[-1],
                    "policy_loss": policy_loss,
                    "value_loss_before": before,
                    "value_loss_after": after,
                }
            ),
            flush=True,
        )
    service.close("success")
    print("RESULT " + json.dumps({"rewards": rewards_by_iteration, "value_losses": value_losses}), flush=True)


if __name__ == "__main__":
    main()
