"""The ChatML chat template the tests share (a module of its own: ``conftest`` names more than one
module in this tree, so tests cannot import from it)."""

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML chat template (Qwen's turn layout, without its default system prompt)."""
