"""Tiny random-weight models of every tiny architecture, each with its own trained byte-level BPE
tokenizer in its family's special-token conventions, saved as the Hugging Face directories a user
brings (config.json + model.safetensors + tokenizer files), plus the sorting task's data.

Which special tokens each family has is what matters here, not the ids' values: GPT-2's one
``<|endoftext|>`` is BOS, EOS and UNK and there is no pad token; Qwen2 has no BOS, ends a turn with
``<|im_end|>`` and pads with ``<|endoftext|>`` and its prompts are ChatML; OPT's BOS is its EOS;
Pythia (GPT-NeoX) pads with ``<|padding|>``; the others have a pad token distinct from EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from openaligner.models.builders import SpecialIds, TinyArch, TinySize, build_tiny_causal_lm
from openaligner.models.tokenizers import train_bpe_tokenizer
from openaligner.tasks.sorting import TaskData, generate_task_data, write_jsonl

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2's ChatML: each turn is ``<|im_start|>role\\ncontent<|im_end|>\\n``."""


@dataclass(frozen=True)
class Family:
    """One architecture with its tokenizer's conventions and what the matrix checks with it."""

    arch: TinyArch
    special_tokens: tuple[str, ...]  # id order
    eos: str
    bos: str | None
    pad: str | None  # None: no pad token (load_tokenizer then pads with EOS)
    unk: str | None
    checks: str  # what this architecture exercises, for docs/models.md
    chat_template: str | None = None
    config: tuple[tuple[str, object], ...] = ()  # config.json settings a user's checkpoint has on top


_LLAMA_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_GEMMA_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")

FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family(
            "gpt2",
            ("<|endoftext|>",),
            eos="<|endoftext|>",
            bos="<|endoftext|>",
            pad=None,
            unk="<|endoftext|>",
            checks="no pad token (EOS pads); BOS = EOS; tied head; learned positions; fast GPT-2 decoder",
        ),
        Family(
            "llama",
            _LLAMA_TOKENS,
            eos="</s>",
            bos="<s>",
            pad="<pad>",
            unk="<unk>",
            checks="grouped-query attention (4 query / 2 key-value heads); rotary positions",
        ),
        Family(
            "mistral",
            _LLAMA_TOKENS,
            eos="</s>",
            bos="<s>",
            pad="<pad>",
            unk="<unk>",
            checks="sliding-window attention in every layer (window 8 < sequence); GQA",
        ),
        Family(
            "mixtral",
            _LLAMA_TOKENS,
            eos="</s>",
            bos="<s>",
            pad="<pad>",
            unk="<unk>",
            checks="sparse mixture of experts (4 experts, 2 per token; fused in memory, per expert on "
            "disk); output_router_logits on, as MoE fine-tuning recipes save it",
            config=(("output_router_logits", True),),
        ),
        Family(
            "qwen2",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            eos="<|im_end|>",
            bos=None,
            pad="<|endoftext|>",
            unk=None,
            checks="tied embeddings; ChatML chat template (prompts rendered with it); no BOS; qkv bias; GQA",
            chat_template=CHATML_TEMPLATE,
        ),
        Family(
            "gemma",
            _GEMMA_TOKENS,
            eos="<eos>",
            bos="<bos>",
            pad="<pad>",
            unk="<unk>",
            checks="multi-query attention (1 key-value head); embedding scaled by sqrt(hidden); tied head",
        ),
        Family(
            "gemma2",
            _GEMMA_TOKENS,
            eos="<eos>",
            bos="<bos>",
            pad="<pad>",
            unk="<unk>",
            checks="sliding window in every other layer (window 8); attention and logit soft-capping; tied",
        ),
        Family(
            "phi3",
            ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"),
            eos="<|end|>",
            bos="<s>",
            pad="<|endoftext|>",
            unk="<unk>",
            checks="fused qkv and gate/up projections",
        ),
        Family(
            "gpt_neox",
            ("<|endoftext|>", "<|padding|>"),
            eos="<|endoftext|>",
            bos="<|endoftext|>",
            pad="<|padding|>",
            unk="<|endoftext|>",
            checks="untied embed_out head (renamed on load); parallel residual; partial rotary",
        ),
        Family(
            "opt",
            ("<s>", "<pad>", "</s>", "<unk>"),
            eos="</s>",
            bos="</s>",
            pad="<pad>",
            unk="<unk>",
            checks="learned positions offset by 2; BOS = EOS; tied head",
        ),
    )
}

VOCAB_SIZE = 320
"""BPE vocabulary: special tokens + 256 byte symbols + the merges learnt from the task's texts."""

MODEL_SIZE = TinySize(vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=2, num_heads=4, max_positions=64)
"""Dimensions of every zoo model (vocab_size becomes the tokenizer's length)."""

TASK = generate_task_data(seed=11, n_sft=32, n_pref=32, n_ppo=32, n_val=8)
"""The sorting task's data sets, shared by every architecture."""

_EXTRA_TEXT = (
    "Sort the digits in ascending order and answer with the sorted list only.",
    "The user asks; the assistant answers.",
)


def corpus(task: TaskData = TASK) -> list[str]:
    """The fixed texts every zoo tokenizer is trained on."""
    texts = [r["prompt"] + " " + r["response"] for r in task.sft]
    texts += [r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in task.preferences]
    texts += [r["prompt"] for r in task.ppo_prompts]
    return texts + list(_EXTRA_TEXT)


def build_tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """The family's BPE tokenizer trained on :func:`corpus` (deterministic)."""
    return train_bpe_tokenizer(
        corpus(),
        VOCAB_SIZE,
        family.special_tokens,
        eos_token=family.eos,
        bos_token=family.bos,
        pad_token=family.pad,
        unk_token=family.unk,
        chat_template=family.chat_template,
    )


def save_model_dir(family: Family, directory: Path, seed: int = 0) -> PreTrainedTokenizerFast:
    """Write the family's tiny causal LM and its tokenizer to ``directory``, as a user brings a
    model: the config states the tokenizer's special ids. Returns the tokenizer."""
    tokenizer = build_tokenizer(family)
    size = replace(MODEL_SIZE, vocab_size=len(tokenizer))
    model = build_tiny_causal_lm(family.arch, size, seed, ids=SpecialIds.of(tokenizer))
    for key, value in family.config:
        setattr(model.config, key, value)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


def render_prompt(family: Family, tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """The prompt as the user would send it: through the chat template when the family has one."""
    if family.chat_template is None:
        return prompt
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)
    return text


def write_task_files(family: Family, tokenizer: PreTrainedTokenizerFast, directory: Path) -> dict[str, Path]:
    """The SFT, preference and PPO prompt files for ``family``, as plain text records: the
    commands render them with the tokenizer's chat template when it has one (data.chat_template=auto)."""
    return {
        "sft": write_jsonl(TASK.sft, directory / "sft.jsonl"),
        "pairs": write_jsonl(TASK.preferences, directory / "pairs.jsonl"),
        "prompts": write_jsonl(TASK.ppo_prompts, directory / "prompts.jsonl"),
    }
