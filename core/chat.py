"""Rendering chat messages with each model's own template."""
from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

# GGUF files do not always carry a chat template; these are the published formats of such families.
_FALLBACK_TEMPLATES = {
    "gemma3_text": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "{% if m['role'] == 'system' %}{{ '<start_of_turn>user\n' + m['content'] + '\n\n' }}{% set ns = 1 %}"
        "{% else %}{% if role == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system' %}"
        "{{ m['content'] + '<end_of_turn>\n' }}{% else %}{{ '<start_of_turn>' + role + '\n' + m['content'] + '<end_of_turn>\n' }}"
        "{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}
_FALLBACK_TEMPLATES["gemma3"] = _FALLBACK_TEMPLATES["gemma3_text"]
_FALLBACK_TEMPLATES["gemma2"] = _FALLBACK_TEMPLATES["gemma3_text"]


def render_chat(tokenizer: PreTrainedTokenizerBase, model_type: str, messages: list[Message]) -> str:
    """The prompt text for `messages` under this model's chat template, ending with the assistant cue."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    template = tokenizer.chat_template or _FALLBACK_TEMPLATES.get(model_type)
    if template is None:
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nAssistant:"
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
