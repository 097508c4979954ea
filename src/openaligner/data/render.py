"""How prompts and responses become token ids: the one sequence layout that train-sft, train-rm,
train-ppo and the reward server's ``sentences`` share.

Owns :class:`SequenceLayout` (BOS, EOS, chat template on or off) and ``sequence_layout.json``,
whether a chat template is used (``auto | true | false``), rendering and cutting conversations,
and the BOS/EOS rule (added once, never doubled). Knows tokenizers; must not know models, configs
or training. Design notes (the layout): docs/data.md, "Module notes".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from openaligner.data.formats import Message, Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LAYOUT_FILE = "sequence_layout.json"
"""The layout a model was trained with, written next to its weights by train-sft and train-rm."""

CHAT_TEMPLATE_MODES = ("auto", "true", "false")
"""``data.chat_template``: auto = use the tokenizer's template when it has one; true = require it;
false = raw text."""


class LayoutError(ValueError):
    """Data that cannot be laid out with this tokenizer: a conversation without a chat template,
    a template that breaks the prefix rule, a layout file that cannot be read."""


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence is laid out in tokens (docs/data.md, "Module notes")."""

    add_bos: bool = True  # the tokenizer's BOS id starts each sequence (when it has one; never doubled)
    add_eos: bool = True  # the EOS id ends each response (never doubled)
    chat_template: bool = False  # conversations rendered with the tokenizer's chat template

    def special_ids(self, tokenizer: PreTrainedTokenizerBase) -> tuple[int | None, int | None]:
        """``(bos_id, eos_id)`` this layout adds with ``tokenizer``; None where it adds none.

        The start and end tokens are the tokenizer's BOS and EOS; a tokenizer without a BOS (EOS)
        that has a CLS (SEP) token — BERT's WordPiece family: BERT, MiniLM, ELECTRA, ... — uses that
        instead: the ``[CLS] text [SEP]`` its encoders were trained on and its own ``tokenizer(text)``
        writes (DeBERTa's and RoBERTa's tokenizers name those tokens BOS and EOS already).
        """
        return (
            _special_id(tokenizer, "bos", "cls") if self.add_bos else None,
            _special_id(tokenizer, "eos", "sep") if self.add_eos else None,
        )

    def save(self, directory: str | Path) -> None:
        """Write ``directory/sequence_layout.json``."""
        (Path(directory) / LAYOUT_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> SequenceLayout | None:
        """The layout recorded in ``directory`` (None when it has no ``sequence_layout.json``).

        Raises:
            LayoutError: the file is not a JSON object of booleans with this class's fields.
        """
        path = Path(directory) / LAYOUT_FILE
        if not path.is_file():
            return None
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LayoutError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
        names = set(cls.__dataclass_fields__)
        if (
            not isinstance(fields, dict)
            or set(fields) != names
            or not all(isinstance(v, bool) for v in fields.values())
        ):
            raise LayoutError(
                f"{path} must be a JSON object with the booleans {sorted(names)}, got {fields!r}"
            )
        return cls(**fields)


def _special_id(tokenizer: PreTrainedTokenizerBase, name: str, encoder_name: str) -> int | None:
    """``tokenizer``'s ``<name>_token_id``, else its ``<encoder_name>_token_id`` (see
    :meth:`SequenceLayout.special_ids`); None when it has neither."""
    value = getattr(tokenizer, f"{name}_token_id", None)
    if value is None:
        value = getattr(tokenizer, f"{encoder_name}_token_id", None)
    return None if value is None else int(value)


def with_bos(ids: Sequence[int], bos_id: int | None) -> list[int]:
    """``[bos_id] + ids``, unless ``bos_id`` is None or ``ids`` already start with it."""
    return list(ids) if bos_id is None or list(ids[:1]) == [bos_id] else [bos_id, *ids]


def with_eos(ids: Sequence[int], eos_id: int | None) -> list[int]:
    """``ids + [eos_id]``, unless ``eos_id`` is None or ``ids`` already end with it."""
    return list(ids) if eos_id is None or list(ids[-1:]) == [eos_id] else [*ids, eos_id]


def response_part(rendered_turn: str) -> str:
    """What the layout keeps of the rendered assistant turn (the text after the prompt part): all
    but the whitespace the template writes after the turn (ChatML's and Zephyr's ``\\n``), since the
    actor's response ends at its stop token."""
    return rendered_turn.rstrip()


def cut_rendered(text: str, generation_prompt: str | None) -> tuple[str, str] | None:
    """``(prompt part, response part)`` of a conversation rendered whole with a chat template, cut
    where :meth:`Renderer.example_ids` cuts the conversation: after the *last* ``generation_prompt``
    in ``text`` (the assistant turn that ends the conversation), the response part by
    :func:`response_part`. None when ``text`` holds no generation prompt (it renders no assistant
    turn). A response whose own text holds the generation prompt is cut there instead: the layout
    of such a text is ambiguous."""
    if not generation_prompt:
        return None
    at = text.rfind(generation_prompt)
    if at < 0:
        return None
    end = at + len(generation_prompt)
    return text[:end], response_part(text[end:])


def generation_prompt(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The text ``tokenizer``'s chat template adds for ``add_generation_prompt=True``
    (``<|im_start|>assistant\\n`` in ChatML): where the prompt part of a rendered conversation ends.
    None: no template, one that cannot render a lone user message, or one whose generation prompt
    does not extend the conversation it follows (train-rm refuses such a template: see
    :meth:`Renderer.example_ids`)."""
    if not has_chat_template(tokenizer):
        return None
    probe = [{"role": "user", "content": "?"}]
    try:
        without = render_chat(tokenizer, probe, generation_prompt=False)
        with_prompt = render_chat(tokenizer, probe, generation_prompt=True)
    except (LayoutError, TemplateError):  # e.g. a template that insists on a system message first
        return None
    if not with_prompt.startswith(without) or with_prompt == without:
        return None
    return with_prompt[len(without) :]


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], generation_prompt: bool
) -> str:
    """``messages`` rendered to text with ``tokenizer``'s chat template.

    Raises:
        LayoutError: the template answered something else than the text.
    """
    out: Any = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt
    )
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    if not isinstance(out, str):
        raise LayoutError(
            f"{tokenizer_name(tokenizer)}: apply_chat_template(tokenize=False) returned "
            f"{type(out).__name__}, not the rendered text"
        )
    return out


def check_chat_template_mode(value: str, key: str) -> str:
    """``value`` of ``key`` normalised to one of :data:`CHAT_TEMPLATE_MODES` (YAML's ``true`` reaches a
    string field as ``"True"``).

    Raises:
        ValueError: naming ``key`` and the accepted values.
    """
    mode = str(value).strip().lower()
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"{key} must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {value!r}")
    return mode


def tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    """Where a tokenizer was loaded from, for messages (``the built-in tokenizer`` when in-process)."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"the tokenizer in {name}" if name else "the built-in tokenizer"


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template(mode: str, tokenizer: PreTrainedTokenizerBase, key: str = "data.chat_template") -> bool:
    """Whether to render with ``tokenizer``'s chat template under ``mode`` (``auto | true | false``).

    Raises:
        LayoutError: ``mode`` is ``true`` and the tokenizer has no chat template.
    """
    if mode == "true" and not has_chat_template(tokenizer):
        raise LayoutError(
            f"{key}=true but {tokenizer_name(tokenizer)} has no chat template (no chat_template in its "
            f"tokenizer_config.json nor a chat_template.jinja); use a tokenizer that has one, or set "
            f"{key}=false to train on raw text"
        )
    return has_chat_template(tokenizer) if mode == "auto" else mode == "true"


def tokenizer_fingerprint(
    tokenizer: PreTrainedTokenizerBase, layout: SequenceLayout | None = None, *, template: bool = True
) -> str:
    """A stable sha256 hex digest of what decides the token ids of a text: the vocabulary (token ->
    id, added tokens included), the special tokens and their ids (not the pad token: padding is
    never read, and loaders make the EOS the pad of a tokenizer without one), the chat template (unless
    ``template`` is false: what ids *mean* does not depend on it) and, when given, the
    :class:`SequenceLayout`. Equal for a tokenizer saved and reloaded; different when any of these
    differ. The tokenizer's name and class are left out (the same files under two paths, or a slow
    and a fast tokenizer of one vocabulary, give the same ids)."""
    special = {
        name: [str(value), tokenizer.convert_tokens_to_ids(str(value))]
        for name, value in sorted(getattr(tokenizer, "special_tokens_map", {}).items())
        if isinstance(value, str) and name != "pad_token"  # padding is never read: loaders set it freely
    }
    identity = {
        "vocab": sorted((str(t), int(i)) for t, i in tokenizer.get_vocab().items()),
        "special": special,
        "chat_template": (getattr(tokenizer, "chat_template", None) or None) if template else None,
        "layout": None if layout is None else _effective_layout(tokenizer, layout),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _effective_layout(tokenizer: PreTrainedTokenizerBase, layout: SequenceLayout) -> dict[str, object]:
    """What ``layout`` does with ``tokenizer``: the BOS/EOS ids it adds (None: none, e.g. asked for
    but the tokenizer has no BOS) and whether a template renders conversations. Two layouts that
    differ only in a switch the tokenizer cannot act on lay text out alike, so they compare equal."""
    bos, eos = layout.special_ids(tokenizer)
    return {"bos": bos, "eos": eos, "chat_template": layout.chat_template and has_chat_template(tokenizer)}


def tokenizer_identity(
    tokenizer: PreTrainedTokenizerBase, layout: SequenceLayout | None
) -> tuple[str, str, str]:
    """``(name, fingerprint, vocab_fingerprint)`` of a tokenizer: where it was loaded from, its
    :func:`tokenizer_fingerprint` with ``layout`` (how a model lays text out with it) and without
    layout or template (what its ids mean)."""
    return (
        tokenizer_name(tokenizer),
        tokenizer_fingerprint(tokenizer, layout if layout is not None else SequenceLayout()),
        tokenizer_fingerprint(tokenizer, template=False),
    )


@contextmanager
def located(where: str) -> Iterator[None]:
    """Prefix a :class:`LayoutError` raised inside with ``where`` (a record's place in its file)."""
    try:
        yield
    except LayoutError as e:
        raise LayoutError(f"{where}: {e}") from None


class Renderer:
    """Token ids of prompts and of prompt + response examples, laid out by one :class:`SequenceLayout`.

    Args:
        tokenizer: any Hugging Face tokenizer.
        layout: the layout; with ``chat_template`` the tokenizer must have a template.

    Raises:
        LayoutError: ``layout.chat_template`` without a template, or ``add_eos`` without an EOS token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, layout: SequenceLayout) -> None:
        if layout.chat_template and not has_chat_template(tokenizer):
            raise LayoutError(
                f"{tokenizer_name(tokenizer)} has no chat template to render conversations with"
            )
        self.tokenizer = tokenizer
        self.layout = layout
        self.bos_id, self.eos_id = layout.special_ids(tokenizer)
        if layout.add_eos and self.eos_id is None:
            name = tokenizer_name(tokenizer)
            raise LayoutError(
                f"data.add_eos is true but {name} has no EOS token (nor a SEP token); set data.add_eos=false"
            )

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids of a prompt, ending where the response starts: ``[BOS] + ids(text)``, or the
        template's rendering with the generation prompt (``[BOS]`` added unless it writes one)."""
        return with_bos(self._encode(self._prompt_text(prompt)), self.bos_id)

    def example_ids(self, prompt: Prompt, response: Message) -> tuple[list[int], list[int]]:
        """``(prompt ids, response ids)`` of a prompt and its assistant response; the prompt ids
        equal :meth:`prompt_ids`. The response ids end with ``[EOS]`` (when ``add_eos``).

        Raises:
            LayoutError: a conversation without the chat template, or a template whose rendering of
                the prompt (with the generation prompt) does not start its rendering of the whole
                conversation.
        """
        prompt_text = self._prompt_text(prompt)
        if self.layout.chat_template:
            full = self._render([*self._conversation(prompt), response], generation_prompt=False)
            if not full.startswith(prompt_text):
                raise LayoutError(self._prefix_problem(prompt_text, full))
            response_text = response_part(full[len(prompt_text) :])
        else:
            response_text = str(response["content"])
        prompt_ids = with_bos(self._encode(prompt_text), self.bos_id)
        return prompt_ids, with_eos(self._encode(response_text), self.eos_id)

    # ------------------------------------------------------------------ helpers
    def _prompt_text(self, prompt: Prompt) -> str:
        if self.layout.chat_template:
            return self._render(self._conversation(prompt), generation_prompt=True)
        if not isinstance(prompt, str):
            why = (
                "data.chat_template is false"
                if has_chat_template(self.tokenizer)
                else f"{tokenizer_name(self.tokenizer)} has no chat template"
            )
            raise LayoutError(
                f"a conversation (messages) needs a chat template to become text, but {why}; use a "
                "tokenizer with a chat template (data.chat_template=auto or true), or give text prompts"
            )
        return prompt

    @staticmethod
    def _conversation(prompt: Prompt) -> list[Message]:
        """A text prompt is a single user message."""
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _prefix_problem(self, prompt_text: str, full: str) -> str:
        at = next((i for i, (a, b) in enumerate(zip(prompt_text, full, strict=False)) if a != b), len(full))
        return (
            f"the chat template of {tokenizer_name(self.tokenizer)} renders the prompt with the "
            "generation prompt differently from the start of the whole conversation, so the response "
            f"cannot be cut from it: at character {at} the prompt has {prompt_text[at : at + 30]!r} and "
            f"the conversation {full[at : at + 30]!r}. Use a template whose generation prompt starts "
            "the assistant turn as written in the conversation, or set data.chat_template=false"
        )
