"""The demo's verdict: the SFT and RL-trained policies on held-out prompts, scored by the gold scorer.

Owns the evaluation metrics of the report (gold score sampled and greedy, the reward server's score
— the reward model's, or the gold function's with ``reward=gold`` —, KL to the SFT policy, response
length, properly ended). Knows the run directory's layout and the sorting task; nothing of how the
models were trained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from openaligner.algorithms import response_mask
from openaligner.cli.demo.presets import MAX_NEW_TOKENS, Variant
from openaligner.clients.reward import RemoteGPTRMClient, RemoteRMConfig
from openaligner.data.records import read_records
from openaligner.data.render import Renderer, SequenceLayout, use_chat_template
from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.models.tokenizers import load_tokenizer
from openaligner.tasks.sorting import mean_gold_score
from openaligner.trainer.rollout import make_prompt_collate, rollout_texts


def evaluate(
    run_dir: Path, seed: int, samples: int, host: str, rm_port: int, variant: Variant
) -> dict[str, dict[str, float]]:
    """Gold score, reward-server score, KL to the SFT policy and length, before and after RL.

    Args:
        run_dir: the demo's run directory (tokenizer, validation prompts, ``sft``, the RL stage's
            ``actor``).
        seed: seeds the sampled responses.
        samples: how many of the validation prompts to score.
        host, rm_port: where the reward server answers.
        variant: which RL stage's policy to score (its ``rl_dir``), and whether the reward server
            reads token ids (the reward model) or text (the gold function).

    Returns:
        ``{"sft": metrics, "ppo": metrics}`` (``ppo``: the RL-trained policy, whatever the
        algorithm) with ``gold``, ``gold_greedy``, ``rm_score`` (the reward server's score),
        ``kl_to_sft`` (nats per response), ``response_tokens`` and ``properly_ended``.
    """
    tokenizer = load_tokenizer(run_dir / "tokenizer")
    prompts = [str(r.fields["prompt"]) for r in read_records(run_dir / "data" / "val_prompts.jsonl")]
    prompts = prompts[:samples]
    renderer = Renderer(tokenizer, SequenceLayout(chat_template=use_chat_template("auto", tokenizer)))
    ids = [renderer.prompt_ids(p) for p in prompts]  # laid out as train-ppo lays out its prompts
    batch = make_prompt_collate(0)(ids)
    sft = CausalLMActor.from_pretrained(run_dir / "sft", init_policy=False)
    ppo = CausalLMActor.from_pretrained(run_dir / variant.rl_dir / "actor", init_policy=False)
    sampled = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=1)
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW_TOKENS)
    for scorer in (sft, ppo):  # the KL below scores the distribution sampled from
        scorer.set_sampling(sampled)

    def responses(actor: CausalLMActor, out: dict[str, torch.Tensor]) -> list[str]:
        stop_ids = actor.sampling.stop_token_ids or ()
        return rollout_texts(
            out["response_tokens"],
            out["prompt_lengths"],
            out["response_lengths"],
            out["is_end"],
            stop_ids,
            lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
        )[1]

    rm_cfg = RemoteRMConfig(ip=host, port=rm_port, pad_to_length=64)
    results: dict[str, dict[str, float]] = {}
    with RemoteGPTRMClient(rm_cfg) as rm:
        for name, actor in (("sft", sft), ("ppo", ppo)):
            out = actor.infer(batch, generator=torch.Generator().manual_seed(seed + 17))
            kl = _kl_per_response(actor, sft, out)
            greedy_out = actor.infer(batch, greedy)
            texts = responses(actor, out)
            if variant.reward == "gold":  # the function reads the conversations, as train-ppo sends them
                conversations = [
                    [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
                    for p, r in zip(prompts, texts, strict=True)
                ]
                rewards = rm.infer_rm_conversations(conversations).result()
            else:
                rewards = rm.infer_rm(out).result()
            results[name] = {
                "gold": mean_gold_score(prompts, texts),
                "gold_greedy": mean_gold_score(prompts, responses(actor, greedy_out)),
                "rm_score": float(rewards.mean()),
                "kl_to_sft": kl,
                "response_tokens": float((out["response_lengths"] - out["prompt_lengths"]).float().mean()),
                "properly_ended": float(out["is_end"].float().mean()),
            }
    return results


def _kl_per_response(actor: CausalLMActor, sft: CausalLMActor, out: dict[str, torch.Tensor]) -> float:
    """Mean over rows of the summed log-ratio (k1) of ``actor`` to ``sft`` on ``actor``'s samples."""
    tokens, lengths, prompt_lengths = out["response_tokens"], out["response_lengths"], out["prompt_lengths"]
    logp = actor.get_inference_log_probs(tokens, lengths, None, prompt_lengths)
    logp_sft = sft.get_inference_log_probs(tokens, lengths, None, prompt_lengths)
    mask = response_mask(prompt_lengths, lengths, tokens.shape[1] - 1)
    return float(((logp - logp_sft) * mask).sum(-1).mean().item())
