"""What a reader keeps of a completion: the one rule that answer extraction and majority voting share."""
from __future__ import annotations

__all__ = ["first_line_answer"]


def first_line_answer(completion: str) -> str:
    """The completion's answer: its text, stripped, before a blank line or a new 'Question:' line (the few-shot
    format's next turn)."""
    text = completion.strip()
    for marker in ("\n\n", "\nQuestion:"):
        text = text.split(marker, 1)[0]
    return text.strip()
