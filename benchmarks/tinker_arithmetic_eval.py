"""What a model served by ``serve-tinker`` answers on tinker-cookbook's arithmetic task: greedy
answers to ``--problems`` fixed addition problems (seeded, the same set every run), prompted and
scored exactly as the cookbook's ``ArithmeticEnv`` does (its few-shot prefix, the renderer's
stop sequence, its own ``check_answer``), through the real ``tinker`` SDK. Run by the Tinker
venv's Python (``make tinker-setup``); prints one JSON object: the exact-answer rate, the share
of well-formed answers (ended by the stop sequence) and the first ``--examples`` answers.

    .venv-tinker/bin/python benchmarks/tinker_arithmetic_eval.py http://127.0.0.1:8000 MODEL_DIR \\
        [--sampler tinker://.../sampler_weights/final] [--problems 64] [--max-tokens 12]

Without ``--sampler`` it answers with the base model itself (a base-model sampling client).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.tokenizer_utils import get_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("model")
    ap.add_argument("--sampler", default=None, help="a tinker:// sampler path; default: the base model")
    ap.add_argument("--renderer", default="role_colon")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args()

    tokenizer = get_tokenizer(args.model)
    renderer = renderers.get_renderer(args.renderer, tokenizer=tokenizer)
    service = tinker.ServiceClient(
        base_url=args.base_url, api_key=os.environ.get("TINKER_API_KEY", "tml-local")
    )
    if args.sampler:
        sampler = service.create_sampling_client(model_path=args.sampler).result()
    else:
        sampler = service.create_sampling_client(base_model=args.model).result()
    rng = np.random.RandomState(args.seed)  # outside the recipe's per-batch seeds 0, 1, ...
    problems = [(int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(args.problems)]
    envs = [
        ArithmeticEnv(x, y, renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
        for x, y in problems
    ]
    params = types.SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, stop=renderer.get_stop_sequences()
    )
    futures = []
    for env in envs:
        convo = [*env.convo_prefix, {"role": "user", "content": env.get_question()}]
        futures.append(sampler.sample(renderer.build_generation_prompt(convo), 1, params))
    correct = formed = 0
    examples = []
    for env, future in zip(envs, futures, strict=True):
        tokens = list(future.result().sequences[0].tokens)
        message, termination = renderer.parse_response(tokens)
        content = renderers.get_text_content(message)
        ok = env.check_answer(content)
        correct += ok
        formed += bool(termination.is_stop_sequence)
        if len(examples) < args.examples:
            examples.append({"question": env.get_question(), "answer": content, "correct": bool(ok)})
    print(
        json.dumps(
            {
                "sampler": args.sampler or "base",
                "problems": len(envs),
                "exact": correct / len(envs),
                "well_formed": formed / len(envs),
                "examples": examples,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
