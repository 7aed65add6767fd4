"""Encoding prompts into a fresh `TreeBatch`, each reusing the KV of the cached prompt it shares most with.

Layout per row: the reused prefix (from column 0), padding up to column `reused`, padding, the new suffix
(right-aligned), so every row's suffix runs in one padded forward over its own reused columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .kv_layer import GrowingLayer, room_to_grow
from .model_runner import ModelRunner
from .prefix_cache import CachedPrompt, PromptPrefixCache
from .token_tree import Row
from .tree_batch import TreeBatch

__all__ = ["prefill"]


@dataclass
class _Layout:
    """Where each prompt's reused prefix and new suffix sit in the padded prefill."""

    matches: list[tuple[CachedPrompt | None, int]]
    suffixes: list[list[int]]
    reused: int
    width: int
    input_ids: torch.Tensor
    mask: torch.Tensor  # batch x (reused + width), 1 for real columns
    positions: torch.Tensor  # each column's position in its row


@torch.inference_mode()
def prefill(runner: ModelRunner, prompts: list[list[int]], pad_token_id: int, prefix_cache: PromptPrefixCache | None = None,
            keep_hidden: bool = False, scored: list[list[bool]] | None = None) -> TreeBatch:
    """Encode `prompts` (token ids) in one forward into a new batch; with `scored`, each row's `prompt_nll` holds the
    NLL of its marked prompt tokens (NaN for the others), for competence scoring. New prompts are cached."""
    layout = _layout(prompts, pad_token_id, prefix_cache, scored is not None)
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    attention = layout.mask
    if layout.reused:
        _load_prefixes(cache, layout)
        attention = _reused_prefix_mask(runner, layout)
    last = torch.zeros_like(layout.input_ids, dtype=torch.bool)
    last[:, -1] = True
    reused, positions = layout.reused, layout.positions
    targets = _targets(layout, scored) if scored is not None else None
    output = runner.run(cache, layout.input_ids, attention, positions[:, reused:], last, layout.mask[:, reused:].bool(),
                        keep_hidden=keep_hidden, targets=targets, kind="prefill")
    rows = [Row(ids=list(p), forwards=1) for p in prompts]
    if scored is not None:
        _record_prompt_nll(rows, layout, output.target_nll)
    runner.counters["tokens"] += sum(len(s) for s in layout.suffixes)
    batch = TreeBatch(runner, cache, rows, list(output.logprobs), list(output.hidden) if keep_hidden else [],
                      positions.to(runner.device), layout.mask.bool().to(runner.device), pad_token_id, keep_hidden)
    if prefix_cache is not None:
        _store_prompts(prefix_cache, batch, prompts)
    return batch


def _layout(prompts: list[list[int]], pad_token_id: int, prefix_cache: PromptPrefixCache | None, with_nll: bool) -> _Layout:
    matches = [prefix_cache.match(p, with_nll) for p in prompts] if prefix_cache else [(None, 0)] * len(prompts)
    lengths = [length for _, length in matches]
    reused = max(lengths)
    suffixes = [p[k:] for p, k in zip(prompts, lengths)]
    width = max(len(s) for s in suffixes)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), reused + width), dtype=torch.long)
    for r, (suffix, length) in enumerate(zip(suffixes, lengths)):
        mask[r, :length] = 1
        input_ids[r, width - len(suffix):] = torch.tensor(suffix)
        mask[r, reused + width - len(suffix):] = 1
    return _Layout(matches, suffixes, reused, width, input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))


def _reused_prefix_mask(runner: ModelRunner, layout: _Layout):
    """With reused prefixes, padding sits inside the rows: the mask is spelled out."""
    reused, width, mask = layout.reused, layout.width, layout.mask
    columns = torch.arange(reused + width)
    allowed = mask.bool()[:, None, :] & (columns[None, None, :] <= (reused + torch.arange(width))[None, :, None])
    allowed[:, torch.arange(width), reused + torch.arange(width)] = True  # padding attends to itself
    positions = layout.positions
    return runner.attention_masks(allowed, positions[:, reused:], positions.to(runner.device))


def _targets(layout: _Layout, scored: list[list[bool]]) -> torch.Tensor:
    """Each suffix position's next suffix token where that token is scored, else -1."""
    width = layout.width
    targets = torch.full_like(layout.input_ids, -1)
    for r, (suffix, (_, length)) in enumerate(zip(layout.suffixes, layout.matches)):
        marks = scored[r]
        wanted = torch.tensor([k < len(marks) and marks[k] for k in range(length + 1, length + len(suffix))], dtype=torch.bool)
        targets[r, width - len(suffix) : width - 1] = torch.where(wanted, torch.tensor(suffix[1:]), -1)
    return targets


def _record_prompt_nll(rows: list[Row], layout: _Layout, target_nll: torch.Tensor) -> None:
    """Each row's prompt token NLLs: the reused part's from its cache entry, the rest from this forward."""
    width = layout.width
    for r, (row, suffix, (entry, length)) in enumerate(zip(rows, layout.suffixes, layout.matches)):
        known = entry.token_nll[:length] if entry else []
        first = entry.token_nll[length] if entry and length < len(entry.ids) and entry.ids[length] == row.ids[length] else float("nan")
        row.prompt_nll = [*known, first, *target_nll[r, width - len(suffix) : width - 1].tolist()]


def _load_prefixes(cache: DynamicCache, layout: _Layout) -> None:
    """Put each row's reused prefix KV in the first cache columns (zeros after it, up to column `reused`), with
    room for the suffix, in one copy."""
    matches, reused, suffix_width = layout.matches, layout.reused, layout.width
    template = next(entry for entry, _ in matches if entry is not None).layers
    for index, (keys, values) in enumerate(template):
        pieces = []
        for r, (entry, length) in enumerate(matches):
            source_keys, source_values = entry.layers[index] if entry else (keys, values)
            pieces.append((r, source_keys[:, :, :length], source_values[:, :, :length]))
        layer = GrowingLayer()
        layer.place(len(matches), reused, pieces, spare=suffix_width + room_to_grow(reused + suffix_width), left_aligned=True)
        cache.layers.append(layer)


def _store_prompts(prefix_cache: PromptPrefixCache, batch: TreeBatch, prompts: list[list[int]]) -> None:
    """Keep every row's prompt KV (its committed columns) for later requests."""
    for r, prompt in enumerate(prompts):
        if any(entry.ids == prompt for entry in prefix_cache.entries):
            continue
        columns = batch.committed[r].nonzero().flatten()
        prefix_cache.store(CachedPrompt(list(prompt), [
            (layer.keys[r:r + 1].index_select(2, columns), layer.values[r:r + 1].index_select(2, columns))
            for layer in batch.cache.layers
        ], batch.rows[r].prompt_nll))
