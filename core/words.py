"""Word boundaries read from a tokenizer's vocabulary, so models with different tokenizers align on words."""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

# Leading markers a token piece uses for "a space or newline precedes me": byte-level BPE (Ġ space,
# Ċ newline, ĉ tab), SentencePiece (▁), and byte-fallback pieces for newline/space/tab.
_WORD_START_PREFIXES = ("Ġ", "Ċ", "ĉ", "▁", " ", "\n", "\t", "<0x0A>", "<0x20>", "<0x09>")
# What a piece that prints only whitespace is made of (č: byte-level carriage return), and the byte-fallback ones.
_BLANK_MARKERS = "ĠĊĉč▁ \n\t\r"
_BLANK_BYTE_PIECES = ("<0x0A>", "<0x20>", "<0x09>", "<0x0D>")


def word_start_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
    """Bool tensor over the model's vocabulary: True where the token begins a new word.

    A word ends where the next token starts a new word, so whole words can be proposed token by token
    without generating a fixed number of tokens and splitting text afterwards.
    """
    return _vocabulary_table(tokenizer, vocab_size, lambda piece: piece.startswith(_WORD_START_PREFIXES))


def blank_token_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
    """Bool tensor over the model's vocabulary: True where the token prints only whitespace.

    Whitespace belongs to the word it precedes ("\\n\\nThe" is one word), so no model proposes a bare line break
    as a word of its own: such a span is never comparable with another model's whole word.
    """
    return _vocabulary_table(tokenizer, vocab_size,
                             lambda piece: bool(piece) and (piece in _BLANK_BYTE_PIECES or not piece.strip(_BLANK_MARKERS)))


def _vocabulary_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int, marks: Callable[[str], bool]) -> torch.Tensor:
    """True for each ordinary (non-special) token within `vocab_size` whose piece `marks` accepts."""
    table = torch.zeros(vocab_size, dtype=torch.bool)
    special = set(tokenizer.all_special_ids)
    for piece, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special and marks(piece):
            table[index] = True
    return table
