"""``openaligner evaluate-task MODEL --task T --prompts FILE [--reference DIR] ...``: a model
directory's gold score on a built-in task's prompts — sampled and greedy — and its KL to a
reference model: the before/after numbers of an RL run (docs/real-model.md).

Thin: reads the prompts, loads the model (and the reference) with the product's actor, generates,
and prints one JSON object. Prompts are laid out as train-ppo lays them out by default (the
tokenizer's chat template when it has one, else raw text; BOS first). What cannot be evaluated —
a missing or adapter-only directory, an unreadable prompt file — is refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

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
    p.add_argument("--prompts", type=Path, required=True, help='JSONL of {"prompt": ...} records')
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
    for key, path in (("model", args.model), ("--reference", args.reference)):
        if path is not None:
            _check_model_dir(key, path)
    from openaligner.data.records import DataFileError, read_records

    try:
        records = read_records(args.prompts)
        prompts = [str(r.fields["prompt"]) for r in records][: args.limit]
    except DataFileError as e:
        raise StartupError(f"--prompts: {e}") from None
    except KeyError:
        raise StartupError(f'--prompts {args.prompts}: every record needs a "prompt" field') from None
    print(json.dumps(evaluate(args, prompts)))
    return 0


def _check_model_dir(key: str, path: Path) -> None:
    from openaligner.models.lora import adapter_directory_problem
    from openaligner.models.source import check_model_dir

    problem = adapter_directory_problem(path)
    if problem:
        raise StartupError(f"{key} {path} {problem}")
    try:
        check_model_dir(str(path), key)
    except ValueError as e:
        raise StartupError(str(e)) from None


def evaluate(args: argparse.Namespace, prompts: list[str]) -> dict[str, object]:
    """The metrics of ``args.model`` on ``prompts``: ``gold`` (sampled at temperature 1),
    ``gold_greedy``, ``kl_to_reference`` (nats per response, k1 on the model's own samples; with
    ``--reference``), ``response_tokens`` and ``properly_ended`` (means over the prompts)."""
    import torch

    from openaligner.algorithms import response_mask
    from openaligner.data.render import Renderer, SequenceLayout, use_chat_template
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import SamplingParams
    from openaligner.models.tokenizers import load_tokenizer
    from openaligner.tasks import task_scorer
    from openaligner.trainer.rollout import make_prompt_collate, rollout_texts

    tokenizer = load_tokenizer(args.model)
    renderer = Renderer(tokenizer, SequenceLayout(chat_template=use_chat_template("auto", tokenizer)))
    batch = make_prompt_collate(0)([renderer.prompt_ids(p) for p in prompts])
    stops = tuple(args.end_string)
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=1, stop_strings=stops)
    greedy = SamplingParams(greedy=True, max_new_tokens=args.max_new_tokens, stop_strings=stops)
    model = CausalLMActor.from_pretrained(
        args.model, dtype=torch.float32, tokenizer=tokenizer, sampling=sampled, init_policy=False
    )
    score = task_scorer(args.task)

    def texts(out: dict[str, torch.Tensor]) -> list[str]:
        stop_ids = model.sampling.stop_token_ids or ()
        return rollout_texts(
            out["response_tokens"], out["prompt_lengths"], out["response_lengths"], out["is_end"],
            stop_ids, lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
        )[1]  # fmt: skip

    out = model.infer(batch, generator=torch.Generator().manual_seed(args.seed))
    greedy_out = model.infer(batch, greedy)
    metrics: dict[str, object] = {
        "model": str(args.model),
        "task": args.task,
        "prompts": len(prompts),
        "gold": sum(score(prompts, texts(out))) / len(prompts),
        "gold_greedy": sum(score(prompts, texts(greedy_out))) / len(prompts),
        "response_tokens": float((out["response_lengths"] - out["prompt_lengths"]).float().mean()),
        "properly_ended": float(out["is_end"].float().mean()),
    }
    if args.reference is not None:
        tokens, lengths, starts = out["response_tokens"], out["response_lengths"], out["prompt_lengths"]
        logp = model.get_inference_log_probs(tokens, lengths, None, starts)
        reference = CausalLMActor.from_pretrained(
            args.reference, dtype=torch.float32, tokenizer=tokenizer, sampling=sampled, init_policy=False
        )
        logp_ref = reference.get_inference_log_probs(tokens, lengths, None, starts)
        mask = response_mask(starts, lengths, tokens.shape[1] - 1)
        metrics["kl_to_reference"] = float(((logp - logp_ref) * mask).sum(-1).mean())
    return metrics
