"""Answer matching for the QA benchmarks: lenient (normalised, containment) and strict exact match."""
from __future__ import annotations

import re
import string

from ..answers import first_line_answer

__all__ = ["exact_match", "first_line_answer", "lenient_match", "normalize_answer"]

_NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13", "fourteen": "14",
    "fifteen": "15", "sixteen": "16", "seventeen": "17", "eighteen": "18", "nineteen": "19", "twenty": "20",
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1000000",
}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans({c: " " for c in string.punctuation})


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and articles removed, number words as digits, whitespace collapsed."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(_NUMBER_WORDS.get(word, word) for word in text.split())


def lenient_match(prediction: str, answers: list[str]) -> bool:
    """True when a normalised accepted answer appears as whole words inside the normalised prediction."""
    predicted = f" {normalize_answer(prediction)} "
    return any(normalized and f" {normalized} " in predicted for normalized in map(normalize_answer, answers))


def exact_match(prediction: str, answers: list[str]) -> bool:
    """True when the normalised prediction equals a normalised accepted answer."""
    predicted = normalize_answer(prediction)
    return any(predicted == normalize_answer(answer) for answer in answers)
