"""A batch of sequences sharing one model's KV cache, each with a scratch token tree on top.

Every row holds its committed prefix (left-padded) followed by scratch tokens: proposals, exploration
branches and candidates under scoring. A scratch token attends to its row's committed prefix and its own
ancestors only, so many branches and candidates go through the model in one forward pass over the cached
prefix. Committing a chosen span moves the cache columns of its tokens into the row's committed prefix and masks
off the rest of its tree, so no token of the shared prefix is ever encoded twice. Rows commit independently (one
row can commit while others hold trees); the dead columns are reclaimed by an occasional compaction, not a
copy per commit.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .cpu_kernels import MIN_GEMM_ROWS, real_tokens

__all__ = ["CachedPrompt", "Node", "OutputHead", "PromptPrefixCache", "TreeBatch"]


@dataclass
class CachedPrompt:
    """One encoded prompt: its token ids, every layer's keys and values for them ([1, heads, tokens, dim]) and,
    when it was asked for, each token's NLL given the ones before it (NaN where unknown: the first token)."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    token_nll: list[float] | None = None


@dataclass
class PromptPrefixCache:
    """KV of the prompts a model encoded most recently, so new prompts that begin like one of them skip that part.

    Few-shot and RAG prompts share long preambles, and consecutive questions often share their context; reusing
    that KV removes most of the prefill. Each new prompt reuses the entry it shares the longest prefix with.
    """

    min_tokens: int = 16
    max_entries: int = 8
    max_tokens: int = 8192  # all entries together (their KV is a copy per entry)
    entries: list[CachedPrompt] = field(default_factory=list)  # most recent first

    def match(self, prompt: list[int], with_nll: bool = False) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that length (at least one prompt token is left to
        run; shorter than `min_tokens` counts as nothing). `with_nll` considers only entries that kept token NLLs."""
        best, longest = None, 0
        for entry in self.entries:
            if with_nll and entry.token_nll is None:
                continue
            shared = _common_prefix(entry.ids, prompt, len(prompt) - 1)
            if shared > longest:
                best, longest = entry, shared
        return (best, longest) if longest >= self.min_tokens else (None, 0)

    def followers(self, prompts: list[list[int]], gain: int = 64) -> list[int]:
        """Rows that share at least `gain` more tokens with an earlier row of their batch than with any cached
        prompt, so encoding them after that row (which gets cached) saves recomputing the shared part."""
        later: list[int] = []
        for i, prompt in enumerate(prompts):
            in_batch = max((_common_prefix(prompts[j], prompt, len(prompt) - 1) for j in range(i) if j not in later), default=0)
            if in_batch >= self.match(prompt)[1] + gain:
                later.append(i)
        return later

    def store(self, entry: CachedPrompt) -> None:
        """Keep `entry` as the most recent; entries it extends are dropped, and the oldest beyond the limits."""
        kept, total = [entry], len(entry.ids)
        for old in self.entries:
            if _common_prefix(old.ids, entry.ids, len(old.ids)) < len(old.ids):
                total += len(old.ids)
                if len(kept) == self.max_entries or total > self.max_tokens:
                    break
                kept.append(old)
        self.entries = kept


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit`."""
    limit = min(limit, len(a), len(b))
    return next((i for i in range(limit) if a[i] != b[i]), max(limit, 0))


@dataclass
class OutputHead:
    """A causal LM split into its decoder stack and its output projection.

    Over a large vocabulary the projection costs as much as the rest of a small model (Gemma 3 270M: 168M of
    its 268M weights), so it is applied only at the positions whose next-token distribution is needed, not
    at padding.
    """

    decoder: torch.nn.Module
    projection: torch.nn.Module
    softcap: float | None = None

    @classmethod
    @torch.inference_mode()
    def of(cls, model: PreTrainedModel) -> "OutputHead | None":
        """Split `model`, or None where its logits are not the projection of its decoder's output (checked)."""
        decoder, projection = model.get_decoder(), model.get_output_embeddings()
        if decoder is model or projection is None:
            return None
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head = cls(decoder, projection, getattr(text_config, "final_logit_softcapping", None))
        probe = torch.arange(1, 4, device=model.device)[None]
        try:
            expected = model(input_ids=probe, use_cache=False).logits
            split = head.logits(decoder(input_ids=probe, use_cache=False).last_hidden_state)
        except (TypeError, AttributeError, ValueError):
            return None
        return head if torch.allclose(expected.float(), split.float(), atol=1e-4, rtol=1e-3) else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projection(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _room_to_grow(columns: int) -> int:
    """Spare columns a cache buffer of `columns` columns gets, so that appending copies the cache only now and then."""
    return max(64, columns // 2)


class _GrowingLayer(DynamicLayer):
    """A cache layer that appends new keys/values into spare capacity.

    `DynamicLayer` concatenates, copying a layer's whole cache at every forward; with a batch of long prompts
    that copy costs as much as the attention itself. Rows selected, compacted or joined are `place`d straight
    into a new buffer with room to grow; keys and values assigned from outside are moved into a fresh buffer at
    the next update.
    """

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._owns(end, key_states):
            self._reserve(length, end, key_states, value_states)
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _owns(self, end: int, key_states: torch.Tensor) -> bool:
        buffer = self._key_buffer
        return (
            buffer is not None and buffer.shape[2] >= end and buffer.shape[:2] == key_states.shape[:2]
            and (self.get_seq_length() == 0 or self.keys.data_ptr() == buffer.data_ptr())
        )

    def place(self, rows: int, width: int, pieces: list[tuple[int, torch.Tensor, torch.Tensor]], spare: int | None = None,
              left_aligned: bool = False) -> None:
        """Make the cache `rows` x `width` columns from pieces `(first row, keys, values)`, each right-aligned (or
        left-aligned) with zeros (masked columns) around it, in one copy into a buffer with `spare` columns more
        for later updates to append to."""
        like = pieces[0][1] if pieces else self.keys
        spare = _room_to_grow(width) if spare is None else spare
        shape = (rows, like.shape[1], width + spare, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        for start, piece_keys, piece_values in pieces:
            end, length = start + piece_keys.shape[0], piece_keys.shape[2]
            first = 0 if left_aligned else width - length
            for buffer, piece in ((keys, piece_keys), (values, piece_values)):
                buffer[start:end, :, :first] = 0
                buffer[start:end, :, first:first + length] = piece
                buffer[start:end, :, first + length:width] = 0
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._key_buffer, self._value_buffer = keys, values
        self.keys, self.values = keys[:, :, :width], values[:, :, :width]

    def _reserve(self, length: int, end: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = end + _room_to_grow(end)
        keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if length:
            keys[:, :, :length], values[:, :, :length] = self.keys, self.values
        self._key_buffer, self._value_buffer = keys, values


@dataclass
class Node:
    """One scratch token: `parent` is a node index or -1 for the committed prefix."""

    token: int
    parent: int
    column: int
    depth: int
    ancestor_columns: list[int]


@dataclass
class _Row:
    ids: list[int]
    forwards: int = 0  # forward passes this row fed tokens to
    nodes: list[Node] = field(default_factory=list)
    children: dict[tuple[int, int], int] = field(default_factory=dict)
    node_logprobs: list[torch.Tensor] = field(default_factory=list)
    node_hidden: list[torch.Tensor] = field(default_factory=list)
    prompt_nll: list[float] | None = None  # each prompt token's NLL, when the batch was asked for them


class TreeBatch:
    """KV cache and scratch trees of one model over a batch of rows.

    `root_logprobs[r]` is the next-token log-distribution after row r's committed prefix; `logprobs(r, i)`
    the one after scratch node i.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        prompts: list[list[int]],
        pad_token_id: int,
        counters: dict[str, int],
        prefix_cache: PromptPrefixCache | None = None,
        keep_hidden: bool = False,
        head: OutputHead | None = None,
        scored: list[list[bool]] | None = None,
    ):
        self.model = model
        self.head = head
        self.prefix_cache = prefix_cache
        self.keep_hidden = keep_hidden  # final-layer states, for policies that read them (TokenAdapter)
        self.scored = scored  # per row, the prompt tokens whose NLL to compute (competence scoring reads them)
        self._hidden: torch.Tensor | None = None
        self._target_nll: torch.Tensor | None = None
        self.pad_token_id = pad_token_id
        self.counters = counters
        self.device = model.device
        self.window, self.layer_types = _attention_layout(model.config)
        self.rows = [_Row(ids=list(p)) for p in prompts]
        self._prefill(prompts)

    # ------------------------------------------------------------------ forward passes
    @torch.inference_mode()
    def _prefill(self, prompts: list[list[int]]) -> None:
        """Encode the prompts, each reusing the KV of the cached prompt it shares the longest prefix with.

        Layout per row: the reused prefix (from column 0), padding up to column `reused`, padding, the new suffix
        (right-aligned), so every row's suffix runs in one padded forward over its own reused columns."""
        matches = [self.prefix_cache.match(p, self.scored is not None) for p in prompts] if self.prefix_cache else [(None, 0)] * len(prompts)
        lengths = [length for _, length in matches]
        reused = max(lengths)
        suffixes = [p[k:] for p, k in zip(prompts, lengths)]
        width = max(len(s) for s in suffixes)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), reused + width), dtype=torch.long)
        for r, (suffix, length) in enumerate(zip(suffixes, lengths)):
            mask[r, :length] = 1
            input_ids[r, width - len(suffix):] = torch.tensor(suffix)
            mask[r, reused + width - len(suffix):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = _GrowingLayer
        if reused:
            self._load_prefixes(matches, reused, width)
        attention = mask
        if reused:  # padding sits inside the rows now: spell the mask out
            columns = torch.arange(reused + width)
            allowed = mask.bool()[:, None, :] & (columns[None, None, :] <= (reused + torch.arange(width))[None, :, None])
            allowed[:, torch.arange(width), reused + torch.arange(width)] = True  # padding attends to itself
            attention = self._attention_masks(allowed, positions[:, reused:], positions.to(self.device))
        last = torch.zeros_like(input_ids, dtype=torch.bool)
        last[:, -1] = True
        targets = None
        if self.scored is not None:  # each suffix position predicts the next suffix token
            targets = torch.full_like(input_ids, -1)
            for r, (suffix, length) in enumerate(zip(suffixes, lengths)):
                marks = self.scored[r]
                wanted = torch.tensor([k < len(marks) and marks[k] for k in range(length + 1, length + len(suffix))], dtype=torch.bool)
                targets[r, width - len(suffix) : width - 1] = torch.where(wanted, torch.tensor(suffix[1:]), -1)
        self.root_logprobs = list(self._run(input_ids, attention, positions[:, reused:], last, mask[:, reused:].bool(), targets))
        self.root_hidden = list(self._hidden) if self.keep_hidden else []
        if self.scored is not None:
            for r, (row, suffix, (entry, length)) in enumerate(zip(self.rows, suffixes, matches)):
                known = entry.token_nll[:length] if entry else []
                first = entry.token_nll[length] if entry and length < len(entry.ids) and entry.ids[length] == row.ids[length] else float("nan")
                row.prompt_nll = [*known, first, *self._target_nll[r, width - len(suffix) : width - 1].tolist()]
        for row in self.rows:
            row.forwards += 1
        self.column_positions = positions.to(self.device)
        self.committed = mask.bool().to(self.device)
        self.counters["tokens"] += sum(len(s) for s in suffixes)
        if self.prefix_cache is not None:
            self._store_prompts(prompts)

    def _load_prefixes(self, matches: list[tuple[CachedPrompt | None, int]], reused: int, suffix_width: int) -> None:
        """Put each row's reused prefix KV in the first cache columns (zeros after it, up to column `reused`), with
        room for the suffix, in one copy."""
        template = next(entry for entry, _ in matches if entry is not None).layers
        for index, (keys, values) in enumerate(template):
            pieces = []
            for r, (entry, length) in enumerate(matches):
                source_keys, source_values = entry.layers[index] if entry else (keys, values)
                pieces.append((r, source_keys[:, :, :length], source_values[:, :, :length]))
            layer = _GrowingLayer()
            layer.place(len(matches), reused, pieces, spare=suffix_width + _room_to_grow(reused + suffix_width),
                        left_aligned=True)
            self.cache.layers.append(layer)

    def _store_prompts(self, prompts: list[list[int]]) -> None:
        """Keep every row's prompt KV (its committed columns) for later requests."""
        for r, prompt in enumerate(prompts):
            if any(entry.ids == prompt for entry in self.prefix_cache.entries):
                continue
            columns = self.committed[r].nonzero().flatten()
            self.prefix_cache.store(CachedPrompt(list(prompt), [
                (layer.keys[r:r + 1].index_select(2, columns), layer.values[r:r + 1].index_select(2, columns))
                for layer in self.cache.layers
            ], self.rows[r].prompt_nll))

    def _run(self, input_ids: torch.Tensor, mask, positions: torch.Tensor, wanted: torch.Tensor, real: torch.Tensor,
             targets: torch.Tensor | None = None) -> torch.Tensor:
        """Forward new tokens (`real` marks them among the padding); return log-distributions at the `wanted`
        positions (bool, batch x width), row-major. With `targets` (the token each position predicts, -1 for
        none), also leave each position's NLL of its target in `_target_nll` (batch x width, NaN elsewhere)."""
        inputs = {
            "input_ids": input_ids.to(self.device),
            "attention_mask": mask.to(self.device) if isinstance(mask, torch.Tensor) else mask,
            "position_ids": positions.to(self.device),
            "use_cache": True,
        }
        wanted = wanted.to(self.device)
        with real_tokens(real.cpu()):
            if self.head is not None:
                states = self.head.decoder(**inputs, **{_cache_argument(self.head.decoder): self.cache}).last_hidden_state
                hidden = states[wanted]
                logits = self.head.logits(hidden)
                if targets is not None:
                    self._target_nll = _target_nll(states, targets.to(self.device), self.head.logits)
            else:
                keep = input_ids.shape[1] if targets is not None else input_ids.shape[1] - int(wanted.any(0).nonzero().min())
                output = self.model(
                    **inputs,
                    logits_to_keep=keep,
                    output_hidden_states=self.keep_hidden,
                    **{_cache_argument(self.model): self.cache},
                )
                logits = output.logits[wanted[:, -keep:]]
                if targets is not None:
                    self._target_nll = _target_nll(output.logits, targets.to(self.device), lambda x: x)
                hidden = output.hidden_states[-1][wanted] if self.keep_hidden else None
        self._hidden = hidden if self.keep_hidden else None
        self.counters["forward_passes"] += 1
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def feed(self, requests: list[list[tuple[int, int]]]) -> list[list[int]]:
        """Run new scratch tokens `(token, parent_node)` for each row in one forward; return their node ids."""
        batch, existing = len(self.rows), self.committed.shape[1]
        width = max(len(r) for r in requests)
        if 1 < batch * width < MIN_GEMM_ROWS:
            width = -(-MIN_GEMM_ROWS // batch)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        wanted = torch.zeros((batch, width), dtype=torch.bool)
        allowed = torch.zeros((batch, width, existing + width), dtype=torch.bool)
        allowed[:, :, :existing] = self.committed[:, None, :].cpu()
        created: list[list[int]] = []
        for r, (row, request) in enumerate(zip(self.rows, requests)):
            created.append([])
            row.forwards += bool(request)
            for k, (token, parent) in enumerate(request):
                column = existing + k
                ancestors = (row.nodes[parent].ancestor_columns if parent >= 0 else []) + [column]
                depth = row.nodes[parent].depth + 1 if parent >= 0 else 1
                row.nodes.append(Node(token, parent, column, depth, ancestors))
                row.children[(parent, token)] = len(row.nodes) - 1
                created[r].append(len(row.nodes) - 1)
                input_ids[r, k] = token
                wanted[r, k] = True
                positions[r, k] = len(row.ids) + depth - 1
                allowed[r, k, ancestors] = True
            for k in range(len(request), width):
                allowed[r, k, existing + k] = True  # padding attends to itself only
        column_positions = torch.cat([self.column_positions, positions.to(self.device)], dim=1)
        logprobs = self._run(input_ids, self._attention_masks(allowed, positions, column_positions), positions, wanted, wanted)
        start = 0
        for r, nodes in enumerate(created):
            self.rows[r].node_logprobs.extend(logprobs[start : start + len(nodes)])
            if self.keep_hidden:
                self.rows[r].node_hidden.extend(self._hidden[start : start + len(nodes)])
            start += len(nodes)
        self.column_positions = column_positions
        self.committed = torch.cat([self.committed, torch.zeros((batch, width), dtype=torch.bool, device=self.device)], 1)
        self.counters["tokens"] += sum(len(r) for r in requests)
        return created

    def _attention_masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
        allowed = allowed.to(self.device)
        dtype = self.model.dtype
        blocked = torch.finfo(dtype).min

        def additive(keep: torch.Tensor) -> torch.Tensor:
            zero = torch.zeros((), dtype=dtype, device=self.device)
            return torch.where(keep, zero, torch.full((), blocked, dtype=dtype, device=self.device))[:, None]

        full = additive(allowed)
        if self.window is None:
            return full
        near = (query_positions.to(self.device)[:, :, None] - key_positions[:, None, :]) < self.window
        sliding = additive(allowed & near)
        if self.layer_types is None:
            return sliding
        return {kind: (sliding if kind == "sliding_attention" else full) for kind in self.layer_types}

    # ------------------------------------------------------------------ tree queries
    def logprobs(self, row: int, node: int) -> torch.Tensor:
        return self.root_logprobs[row] if node < 0 else self.rows[row].node_logprobs[node]

    def find_path(self, row: int, tokens: list[int]) -> tuple[list[int], int]:
        """Nodes already in row's tree along `tokens`; returns (nodes found, index of first missing token)."""
        found, parent = [], -1
        children = self.rows[row].children
        for token in tokens:
            child = children.get((parent, token))
            if child is None:
                break
            found.append(child)
            parent = child
        return found, len(found)

    def ensure_paths(self, paths: list[list[list[int]]]) -> None:
        """Feed, in one forward, whatever tokens of each row's token paths are not yet in its tree."""
        requests = [self.missing(r, row_paths) for r, row_paths in enumerate(paths)]
        if any(requests):
            self.feed(requests)

    def missing(self, row: int, paths: list[list[int]]) -> list[tuple[int, int]]:
        """The `(token, parent)` requests that put every token path in the row's tree (shared prefixes once),
        numbered as `feed` will number them."""
        first_new = len(self.rows[row].nodes)  # node index the first token fed now will get
        planned: dict[tuple[int, ...], int] = {}
        request: list[tuple[int, int]] = []
        for tokens in paths:
            found, start = self.find_path(row, tokens)
            parent = found[-1] if found else -1
            for i in range(start, len(tokens)):
                key = tuple(tokens[: i + 1])
                if key not in planned:
                    planned[key] = first_new + len(request)
                    request.append((tokens[i], parent))
                parent = planned[key]
        return request

    def path_nodes(self, row: int, tokens: list[int]) -> list[int]:
        found, complete = self.find_path(row, tokens)
        if complete != len(tokens):
            raise RuntimeError("scratch tree lacks this token path; ensure_paths must run first")
        return found

    # ------------------------------------------------------------------ commit
    @torch.inference_mode()
    def commit_row(self, row: int, span: list[int]) -> None:
        """Append a span whose tokens are in the row's tree to its committed prefix, and discard its tree.

        No cache copy: the span's columns join the row's committed mask and the rest of its tree is masked off;
        `compact` reclaims the dead columns when they pile up.
        """
        nodes = self.path_nodes(row, span)
        state = self.rows[row]
        if nodes:
            columns = torch.tensor([state.nodes[n].column for n in nodes], device=self.device)
            self.committed[row, columns] = True
            self.root_logprobs[row] = state.node_logprobs[nodes[-1]]
            if self.keep_hidden:
                self.root_hidden[row] = state.node_hidden[nodes[-1]]
        state.ids.extend(span)
        state.nodes, state.children, state.node_logprobs, state.node_hidden = [], {}, [], []

    def commit(self, spans: list[list[int] | None]) -> None:
        """Commit each row's span (None drops the row); tokens not yet in a row's tree are run first."""
        self.ensure_paths([[span] if span else [] for span in spans])
        for r, span in enumerate(spans):
            if span is not None:
                self.commit_row(r, span)
        self.compact([r for r, span in enumerate(spans) if span is not None])

    def live_columns(self) -> int:
        """Columns the busiest row uses: its committed prefix plus its tree."""
        if not self.rows:
            return 0
        return int(max(int(c) + len(r.nodes) for c, r in zip(self.committed.sum(1).tolist(), self.rows)))

    @torch.inference_mode()
    def compact(self, keep_rows: list[int] | None = None, force: bool = False) -> None:
        """Drop rows not in `keep_rows` and, when dead columns outnumber live ones (or `force`), gather every
        row's committed and tree columns into a fresh, narrower cache (tree nodes are renumbered)."""
        keep_rows = list(range(len(self.rows))) if keep_rows is None else keep_rows
        live = self.live_columns()
        if not (force or self.committed.shape[1] - live > max(32, live)):
            if len(keep_rows) < len(self.rows):
                self._select_rows(keep_rows)
            return
        columns = []
        for r in keep_rows:
            committed_columns = self.committed[r].nonzero().flatten().tolist()
            columns.append(committed_columns + [node.column for node in self.rows[r].nodes])
        width = max((len(c) for c in columns), default=0)
        index = torch.zeros((len(keep_rows), width), dtype=torch.long)
        committed = torch.zeros((len(keep_rows), width), dtype=torch.bool)
        for i, (r, cols) in enumerate(zip(keep_rows, columns)):
            offset = width - len(cols)
            index[i, offset:] = torch.tensor(cols, dtype=torch.long)
            committed[i, offset : offset + len(cols) - len(self.rows[r].nodes)] = True
            renumber = {old: offset + new for new, old in enumerate(cols)}
            for node in self.rows[r].nodes:
                node.column = renumber[node.column]
                node.ancestor_columns = [renumber[c] for c in node.ancestor_columns]
        self._select_rows(keep_rows, [torch.tensor(cols, dtype=torch.long, device=self.device) for cols in columns])
        self.column_positions = self.column_positions.gather(1, index.to(self.device))
        self.committed = committed.to(self.device)

    def _select_rows(self, rows: list[int], columns: list[torch.Tensor] | None = None) -> None:
        """Keep the given rows, in that order (a row may repeat): cache, masks and per-row state. With `columns`,
        each kept row's cache keeps only those columns, right-aligned (compaction; the caller sets the masks)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self._layers():
            pieces = [(i, layer.keys[r:r + 1], layer.values[r:r + 1]) for i, r in enumerate(rows)]
            width = layer.keys.shape[2]
            if columns is not None:
                pieces = [(i, keys.index_select(2, c), values.index_select(2, c)) for (i, keys, values), c in zip(pieces, columns)]
                width = max((len(c) for c in columns), default=0)
            layer.place(len(rows), width, pieces)
        self.committed = self.committed.index_select(0, index)
        self.column_positions = self.column_positions.index_select(0, index)
        self.rows = [self.rows[r] for r in rows]
        self.root_logprobs = [self.root_logprobs[r] for r in rows]
        self.root_hidden = [self.root_hidden[r] for r in rows] if self.keep_hidden else []

    def reorder(self, rows: list[int]) -> None:
        """Put the rows (without trees) in this order."""
        self._select_rows(rows)

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    @torch.inference_mode()
    def repeat_rows(self, count: int) -> None:
        """Repeat each row `count` times in place (rows without trees), so parallel samples of one prompt share
        its prefill instead of encoding it `count` times."""
        self._select_rows([r for r in range(len(self.rows)) for _ in range(count)])
        self.rows = [_Row(ids=list(row.ids), forwards=row.forwards) for row in self.rows]

    @torch.inference_mode()
    def extend(self, other: "TreeBatch") -> None:
        """Append the rows of `other` (same model) to this batch, so prompts can join a running batch as others
        finish. The narrower cache is left-padded with masked columns; tree nodes of shifted rows follow."""
        width = max(self.committed.shape[1], other.committed.shape[1])
        for batch in (self, other):
            _shift_nodes(batch.rows, width - batch.committed.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.place(len(self.rows) + len(other.rows), width,
                       [(0, mine.keys, mine.values), (len(self.rows), theirs.keys, theirs.values)])
        self.committed = torch.cat([_left_pad(self.committed, width, 1), _left_pad(other.committed, width, 1)])
        self.column_positions = torch.cat(
            [_left_pad(self.column_positions, width, 1), _left_pad(other.column_positions, width, 1)]
        )
        self.rows += other.rows
        self.root_logprobs += other.root_logprobs
        self.root_hidden += other.root_hidden


def _target_nll(states: torch.Tensor, targets: torch.Tensor, logits_of, chunk: int = 256) -> torch.Tensor:
    """NLL of `targets` (-1: none) under the logits of `states` (batch x width x ...), a chunk of positions at a
    time: a large vocabulary's log-distribution at every prompt position would not fit in memory."""
    nll = torch.full(targets.shape, float("nan"), device=targets.device)
    where = (targets >= 0).nonzero(as_tuple=True)
    picked, wanted = states[where], targets[where]
    values = []
    for start in range(0, len(wanted), chunk):
        logits = logits_of(picked[start : start + chunk]).float()
        values.append(torch.logsumexp(logits, -1) - logits.gather(1, wanted[start : start + chunk, None])[:, 0])
    if values:
        nll[where] = torch.cat(values)
    return nll


def _shift_nodes(rows: list[_Row], offset: int) -> None:
    """Move tree nodes `offset` columns right, after their cache was left-padded by that much."""
    if offset:
        for row in rows:
            for node in row.nodes:
                node.column += offset
                node.ancestor_columns = [c + offset for c in node.ancestor_columns]


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero columns before `tensor` along `dim` up to `width` (zero means masked in the committed mask)."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _cache_argument(model: PreTrainedModel) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; use whichever this model's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _attention_layout(config) -> tuple[int | None, list[str] | None]:
    """Sliding window size and per-layer attention kinds, so custom masks match the model's own."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        kinds = sorted(set(layer_types))
        if "sliding_attention" not in kinds or not window:
            return None, None
        return window, (kinds if len(kinds) > 1 else None)
    if not window or not getattr(text_config, "use_sliding_window", True):
        return None, None
    return window, None
