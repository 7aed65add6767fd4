"""Word boundaries read from a tokenizer's vocabulary, so models with different tokenizers align on words."""
from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

# Leading markers a token piece uses for "a space or newline precedes me": byte-level BPE (Ġ space,
# Ċ newline, ĉ tab), SentencePiece (▁), and byte-fallback pieces for newline/space/tab.
_WORD_START_PREFIXES = ("Ġ", "Ċ", "ĉ", "▁", " ", "\n", "\t", "<0x0A>", "<0x20>", "<0x09>")


def word_start_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
    """Bool tensor over the model's vocabulary: True where the token begins a new word.

    A word ends where the next token starts a new word, so whole words can be proposed token by token
    without generating a fixed number of tokens and splitting text afterwards.
    """
    table = torch.zeros(vocab_size, dtype=torch.bool)
    special = set(tokenizer.all_special_ids)
    for piece, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special and piece.startswith(_WORD_START_PREFIXES):
            table[index] = True
    return table
