"""SFT's response-token NLL from the output head a few positions at a time equals the whole-logits
loss (and its gradients), on every tiny architecture, with LoRA and tied embeddings, and never
builds the [B, S, V] logits."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.hooks import RemovableHandle

from openaligner.config import ConfigError, load_config
from openaligner.models.builders import TINY_ARCHS
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.trainer.sft import SFTConfig, SFTObjective, build_sft_trainer

ATOL = 1e-5  # float32, as the issue asks: the same numbers as the unchunked path


def _budget_for(columns: int, rows: int, vocab: int) -> float:
    """The ``logits_chunk_mb`` that gives ``columns`` positions per chunk."""
    return columns * rows * vocab * 4 / 2**20


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """3 right-padded rows of 12 tokens: lengths 12, 9, 7 and prompts of 3, 5 and 2 tokens (the
    first scored position is 1: 10 next-token columns reach the head)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, vocab, (3, 12), generator=g)
    lengths = torch.tensor([12, 9, 7])
    tokens[1, 9:] = 0
    tokens[2, 7:] = 0
    return {"tokens": tokens, "lengths": lengths, "prompt_lengths": torch.tensor([3, 5, 2])}


def _loss_and_grads(
    objective: SFTObjective, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss as the trainer optimises it (the token mean of the NLL), its token count and the
    gradients of that mean (a float32 sum of ~20 NLLs of ~4.6 is only good to ~1e-5 itself)."""
    objective.module.zero_grad(set_to_none=True)
    nll, count, _ = objective.loss(batch)
    mean = nll / count
    mean.backward()
    grads = {n: p.grad.clone() for n, p in objective.module.named_parameters() if p.grad is not None}
    return mean.detach(), count, grads


def _head_widths(model: Any) -> tuple[list[int], RemovableHandle]:
    """The positions each call of ``model``'s output layer sees (forward and recomputation)."""
    widths: list[int] = []
    layer = model.get_output_embeddings()
    return widths, layer.register_forward_hook(lambda m, i, o: widths.append(o.shape[-2]))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_sft_loss_and_gradients_equal_the_whole_logits(tiny, arch):
    model = tiny.causal_lm(arch)
    model.train()  # as the trainer holds it (the tiny models have no dropout)
    vocab = tiny.size.vocab_size
    batch = _batch(vocab)
    ref_nll, ref_count, ref_grads = _loss_and_grads(SFTObjective(model, logits_chunk_mb=None), batch)
    assert int(ref_count) == (12 - 3) + (9 - 5) + (7 - 2)
    for columns in (1, 3, 4):  # 3 and 4 do not divide the 10 scored columns
        chunked = SFTObjective(copy.deepcopy(model), logits_chunk_mb=_budget_for(columns, 3, vocab))
        widths, hook = _head_widths(chunked.module)
        chunked._head_checked = True  # the one-time 8-position check is not the subject here
        nll, count, grads = _loss_and_grads(chunked, batch)
        hook.remove()
        assert max(widths) == columns, (columns, widths)
        assert int(count) == int(ref_count)
        torch.testing.assert_close(nll, ref_nll, atol=ATOL, rtol=0)
        assert grads.keys() == ref_grads.keys() and grads
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=ATOL, rtol=1e-4, msg=f"{columns}: {name}")


# LoRA: the adapted body and a frozen head; qwen2: tied embeddings (the head's gradient reaches
# the embedding through both uses); gemma2: soft-capped final logits
@pytest.mark.parametrize(("arch", "lora"), [("llama", True), ("qwen2", False), ("gemma2", True)])
def test_chunked_sft_equals_whole_logits_with_lora_tied_weights_and_soft_capping(tiny, arch, lora):
    model = tiny.causal_lm(arch)
    if lora:
        model = add_lora(model, LoraConfig(r=4, target_modules=["all-linear"]))
    model.train()
    vocab = tiny.size.vocab_size
    batch = _batch(vocab)
    ref_nll, _, ref_grads = _loss_and_grads(SFTObjective(model, logits_chunk_mb=None), batch)
    chunked = SFTObjective(copy.deepcopy(model), logits_chunk_mb=_budget_for(3, 3, vocab))
    nll, _, grads = _loss_and_grads(chunked, batch)  # with the one-time head check
    assert chunked._head_checked and chunked.module.training  # the check left it in train mode
    torch.testing.assert_close(nll, ref_nll, atol=ATOL, rtol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=ATOL, rtol=1e-4, msg=name)


def test_the_chunked_sft_loss_never_builds_the_whole_logits(tiny):
    """The output layer never sees more than a chunk, and nothing the backward keeps is as large as
    the whole [B, S-1, V] logits (the recomputed chunks' are freed chunk by chunk)."""
    model = tiny.causal_lm("llama")
    model.train()
    vocab = tiny.size.vocab_size
    batch = _batch(vocab)
    objective = SFTObjective(model, logits_chunk_mb=_budget_for(2, 3, vocab))
    objective._head_checked = True  # the one-time 9-token check is not the subject here
    widths, hook = _head_widths(model)
    kept: list[int] = []  # positions of each logits-shaped [..., V] tensor the backward keeps

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == vocab:
            kept.append(t.shape[:-1].numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nll, _, _ = objective.loss(batch)
    nll.backward()
    hook.remove()
    assert widths and max(widths) == 2, widths
    assert max(kept, default=0) <= 3 * 2, kept  # at most a chunk's (the whole: 3 × 10 positions)


def test_small_batches_and_no_budget_take_the_whole_logits(tiny):
    model = tiny.causal_lm("gpt2")
    vocab = tiny.size.vocab_size
    widths, hook = _head_widths(model)
    SFTObjective(model).loss(_batch(vocab))  # 3 × 12 × 100-token vocabulary: far below 256 MiB
    assert widths == [12]  # the model's own forward, every position
    widths.clear()
    SFTObjective(model, logits_chunk_mb=None).loss(_batch(vocab))
    hook.remove()
    assert widths == [12]
    with pytest.raises(ValueError, match="logits_chunk_mb"):
        SFTObjective(model, logits_chunk_mb=0)


def test_a_model_whose_body_and_head_miss_its_logits_is_refused(tiny):
    model = tiny.causal_lm("gpt2")
    model.config.final_logit_softcapping = 0.5  # GPT-2's forward ignores it; the chunked head would not
    objective = SFTObjective(model, logits_chunk_mb=1e-4)
    with pytest.raises(RuntimeError, match="logits_chunk_mb=null"):
        objective.loss(_batch(tiny.size.vocab_size))


def test_train_sft_reads_and_checks_logits_chunk_mb():
    required = ["data.train_path=x.jsonl"]
    assert load_config(SFTConfig, overrides=required).trainer.logits_chunk_mb == 256.0
    assert (
        load_config(SFTConfig, overrides=[*required, "trainer.logits_chunk_mb=null"]).trainer.logits_chunk_mb
        is None
    )
    with pytest.raises(ConfigError, match=r"trainer\.logits_chunk_mb: must be > 0"):
        load_config(SFTConfig, overrides=[*required, "trainer.logits_chunk_mb=0"])


# activation checkpointing recomputes the body's layers too; under bf16-mixed the head runs in
# bfloat16 under the trainer's autocast (and its check at bf16's tolerance): the same losses, the
# gradients to bfloat16's rounding (the chunks' backward sums in another order)
@pytest.mark.parametrize(
    ("extra", "grad_rel"),
    [([], 1e-5), (["parallel.activation_checkpointing=true"], 1e-5), (["precision=bf16-mixed"], 1e-2)],
)
def test_a_train_sft_step_in_chunks_equals_one_on_the_whole_logits(tmp_path: Path, extra, grad_rel):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(
            f'{{"prompt": "repeat {i % 10}:", "response": " {i % 10}{i % 10}{i % 10}"}}\n' for i in range(16)
        )
    )

    def one_step(chunk_mb: str) -> dict[str, float]:
        cfg = load_config(
            SFTConfig,
            overrides=[
                f"data.train_path={data}",
                f"output_dir={tmp_path / chunk_mb}",
                "model.tiny=llama",
                "model.tiny_hidden_size=32",
                "model.tiny_num_layers=1",
                "model.tiny_num_heads=2",
                "model.tiny_max_positions=64",
                "trainer.global_batch_size=8",
                "trainer.micro_batch_size=4",
                "trainer.max_steps=1",
                f"trainer.logits_chunk_mb={chunk_mb}",
                "optim.lr=3e-3",
                "progress=false",
                "tensorboard=false",
                "device=cpu",
                "resume=false",
                *extra,
            ],
        )
        trainer = build_sft_trainer(cfg)
        positions: list[int] = []
        module: Any = trainer.objective.module
        layer = module.get_output_embeddings()
        hook = layer.register_forward_hook(
            lambda m, i, o: positions.append(o.shape[:-1].numel()) if m.training else None
        )
        metrics = trainer.fit()
        hook.remove()
        if chunk_mb != "null":  # training's 4 rows: 8 positions of logits at a time
            assert max(positions) == 8, positions
        return metrics[-1]

    vocab = 100  # the built-in char tokenizer
    whole, chunked = one_step("null"), one_step(str(_budget_for(2, 4, vocab)))
    for key in ("train/loss", "val/loss"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5), key
    assert chunked["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=grad_rel)
