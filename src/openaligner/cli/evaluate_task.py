"""``openaligner evaluate-task MODEL --task T --prompts FILE [--prompts FILE2] [--reference DIR]
[--base DIR] ...``: a model directory's gold score and exact-task rate on a built-in task's prompts
— sampled and greedy — with example answers, and its KL to a reference model: the before/after
numbers of an SFT or RL run (docs/real-model.md).

Thin: reads the prompt files (one split each), loads the model (and the reference) with the
product's actor, generates, and prints one JSON object with a section per split. Prompts are laid
out as train-ppo lays them out by default (the tokenizer's chat template when it has one, else raw
text; BOS first). An adapter-only directory (a checkpoint's ``step_<N>/actor``) is evaluated over
``--base``, merged in memory. What cannot be evaluated is refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openaligner.config import StartupError
from openaligner.tasks import TASK_SCORERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openaligner evaluate-task",
        description="a model directory's gold score on a built-in task's prompts (sampled and greedy) "
        "and its KL to a reference model; prints JSON",
    )
    p.add_argument("model", type=Path, help="a Hugging Face causal-LM directory (a LoRA run's merged/)")
    p.add_argument("--task", choices=sorted(TASK_SCORERS), required=True, help="whose gold scorer grades")
    p.add_argument(
        "--prompts",
        type=Path,
        action="append",
        required=True,
        help='JSONL of {"prompt": ...} records, one split (repeatable; each reported under its file stem)',
    )
    p.add_argument(
        "--base",
        type=Path,
        default=None,
        help="the base model a LoRA adapter directory (MODEL) is merged into, e.g. a checkpoint's "
        "step_<N>/actor over the run's actor.path",
    )
    p.add_argument("--examples", type=int, default=4, help="example answers shown per split")
    p.add_argument(
        "--reference", type=Path, default=None, help="the model the KL is measured to (e.g. the start)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="most new tokens per response")
    p.add_argument(
        "--end-string",
        action="append",
        default=[],
        help="a string that ends a response besides the EOS token (repeatable), e.g. $'\\n'",
    )
    p.add_argument("--limit", type=int, default=None, help="score only the first N prompts")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampled responses")
    return p


def main(argv: Sequence[str]) -> int:
    """Evaluate and print the JSON object; raises :class:`~openaligner.config.StartupError` (exit 2)
    naming what cannot be evaluated."""
    args = _parser().parse_args(list(argv))
    if args.max_new_tokens < 1:
        raise StartupError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise StartupError(f"--limit must be at least 1, got {args.limit}")
    if args.examples < 0:
        raise StartupError(f"--examples must be at least 0, got {args.examples}")
    if args.base is not None:
        _check_model_dir("--base", args.base)
        if not (args.model / ADAPTER_CONFIG).is_file():
            raise StartupError(
                f"--base is for a LoRA adapter directory; {args.model} holds no {ADAPTER_CONFIG}"
            )
    else:
        _check_model_dir("model", args.model)
    if args.reference is not None:
        _check_model_dir("--reference", args.reference)
    from openaligner.data.records import DataFileError, read_records

    splits: dict[str, list[str]] = {}
    for path in args.prompts:
        if path.stem in splits:
            raise StartupError(
                f"--prompts: two files named {path.stem!r}; each split is reported by its file stem"
            )
        try:
            records = read_records(path)
            splits[path.stem] = [str(r.fields["prompt"]) for r in records][: args.limit]
        except DataFileError as e:
            raise StartupError(f"--prompts: {e}") from None
        except KeyError:
            raise StartupError(f'--prompts {path}: every record needs a "prompt" field') from None
        if not splits[path.stem]:
            raise StartupError(f"--prompts {path}: no records")
    print(json.dumps(evaluate(args, splits)))
    return 0


ADAPTER_CONFIG = "adapter_config.json"


def _check_model_dir(key: str, path: Path) -> None:
    from openaligner.models.lora import adapter_directory_problem
    from openaligner.models.source import check_model_dir

    problem = adapter_directory_problem(path)
    if problem:
        if key == "model":
            problem += ", or evaluate the adapter over its base model with --base"
        raise StartupError(f"{key} {path} {problem}")
    try:
        check_model_dir(str(path), key)
    except ValueError as e:
        raise StartupError(str(e)) from None


def evaluate(args: argparse.Namespace, splits: dict[str, list[str]]) -> dict[str, object]:
    """The metrics of ``args.model`` on each split's prompts (``splits``: name → prompts), as
    ``{"model", "task", "splits": {name: metrics}}``. Each split's metrics: ``gold`` (sampled at
    temperature 1) and ``gold_greedy``; ``exact`` and ``exact_greedy`` (the share of responses
    that do the task exactly, :data:`~openaligner.tasks.TASK_EXACT`); ``kl_to_reference`` (nats
    per response, k1 on the model's own samples; with ``--reference``); ``response_tokens`` and
    ``properly_ended`` (means over the prompts); ``examples`` (the first ``--examples`` prompts:
    ``prompt``, ``greedy`` and ``sampled`` responses, ``target``)."""
    import torch

    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import SamplingParams
    from openaligner.models.tokenizers import load_tokenizer

    # a checkpoint's adapter directory holds the run's tokenizer; one without it uses the base's
    has_tokenizer = (args.model / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(args.model if has_tokenizer or args.base is None else args.base)
    stops = tuple(args.end_string)
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=1, stop_strings=stops)
    if args.base is not None:
        from openaligner.models.lora import load_adapter_merged

        plain = load_adapter_merged(args.model, args.base, torch.float32)
        model = CausalLMActor(plain, tokenizer, sampling=sampled, init_policy=False)
    else:
        model = CausalLMActor.from_pretrained(
            args.model, dtype=torch.float32, tokenizer=tokenizer, sampling=sampled, init_policy=False
        )
    reference = None
    if args.reference is not None:
        reference = CausalLMActor.from_pretrained(
            args.reference, dtype=torch.float32, tokenizer=tokenizer, sampling=sampled, init_policy=False
        )
    results = {
        name: _evaluate_split(args, model, reference, tokenizer, prompts) for name, prompts in splits.items()
    }
    return {"model": str(args.model), "task": args.task, "splits": results}


def _evaluate_split(
    args: argparse.Namespace, model: Any, reference: Any, tokenizer: Any, prompts: list[str]
) -> dict[str, object]:
    """One split's metrics (see :func:`evaluate`)."""
    import torch

    from openaligner.algorithms import response_mask
    from openaligner.data.render import Renderer, SequenceLayout, use_chat_template
    from openaligner.models.generation import SamplingParams
    from openaligner.tasks import TASK_EXACT, TASK_TARGETS, task_scorer
    from openaligner.trainer.rollout import make_prompt_collate, rollout_texts

    renderer = Renderer(tokenizer, SequenceLayout(chat_template=use_chat_template("auto", tokenizer)))
    batch = make_prompt_collate(0)([renderer.prompt_ids(p) for p in prompts])
    stops = tuple(args.end_string)
    greedy = SamplingParams(greedy=True, max_new_tokens=args.max_new_tokens, stop_strings=stops)
    score, exact, target = task_scorer(args.task), TASK_EXACT[args.task], TASK_TARGETS[args.task]

    def texts(out: dict[str, torch.Tensor]) -> list[str]:
        stop_ids = model.sampling.stop_token_ids or ()
        return rollout_texts(
            out["response_tokens"], out["prompt_lengths"], out["response_lengths"], out["is_end"],
            stop_ids, lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
        )[1]  # fmt: skip

    out = model.infer(batch, generator=torch.Generator().manual_seed(args.seed))
    greedy_out = model.infer(batch, greedy)
    sampled_texts, greedy_texts = texts(out), texts(greedy_out)
    n = len(prompts)
    metrics: dict[str, object] = {
        "prompts": n,
        "gold": sum(score(prompts, sampled_texts)) / n,
        "gold_greedy": sum(score(prompts, greedy_texts)) / n,
        "exact": sum(exact(p, r) for p, r in zip(prompts, sampled_texts, strict=True)) / n,
        "exact_greedy": sum(exact(p, r) for p, r in zip(prompts, greedy_texts, strict=True)) / n,
        "response_tokens": float((out["response_lengths"] - out["prompt_lengths"]).float().mean()),
        "properly_ended": float(out["is_end"].float().mean()),
    }
    if reference is not None:
        tokens, lengths, starts = out["response_tokens"], out["response_lengths"], out["prompt_lengths"]
        logp = model.get_inference_log_probs(tokens, lengths, None, starts)
        logp_ref = reference.get_inference_log_probs(tokens, lengths, None, starts)
        mask = response_mask(starts, lengths, tokens.shape[1] - 1)
        metrics["kl_to_reference"] = float(((logp - logp_ref) * mask).sum(-1).mean())
    metrics["examples"] = [
        {"prompt": p, "greedy": g, "sampled": r, "target": target(p)}
        for p, g, r in list(zip(prompts, greedy_texts, sampled_texts, strict=True))[: args.examples]
    ]
    return metrics
