"""A KV cache layer that appends into spare capacity instead of concatenating at every forward."""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "room_to_grow"]


def room_to_grow(columns: int) -> int:
    """Spare columns a cache buffer of `columns` columns gets, so that appending copies the cache only now and then."""
    return max(64, columns // 2)


class GrowingLayer(DynamicLayer):
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
        spare = room_to_grow(width) if spare is None else spare
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
        capacity = end + room_to_grow(end)
        keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if length:
            keys[:, :, :length], values[:, :, :length] = self.keys, self.values
        self._key_buffer, self._value_buffer = keys, values


