"""Faster CPU kernels for a frozen model: oneDNN-packed linear layers and grouped-query attention without copies.

PyTorch's default CPU matmul (MKL sgemm) is slow for the few-row products decoding runs: on a 2-core CPU, a
4-row product costs three times a 1-row one, and the 262k-row Gemma output head takes
43 ms per token. oneDNN with the weight reordered once into its blocked layout is 2-4x faster at every row
count (`benchmarks/bench_decoding.py` reports the end-to-end effect). This is the weight prepacking that
`torch.compile` applies on CPU, without compiling.

transformers' SDPA path repeats every key/value head for grouped-query attention whenever a mask is given,
copying the whole KV cache per layer and step; on CPU, SDPA's own `enable_gqa` does the same attention without
the copy (2.5x faster attention for a batch of 8 rows), and for decoding steps (a few new tokens per row) two
grouped matmuls beat SDPA's kernels again by 1.3-2x.

A batched step's log-distributions are large (22 positions x Gemma's 262k vocabulary is 23 MB, twice: logits and
log-softmax). glibc serves such blocks with fresh `mmap`s or hands them back to the system when freed, so every
step faults its output in again, page by page: up to half of a batched Gemma step on a 2-core CPU. PyTorch's
CPU tuning guide answers this with an allocator that keeps freed memory (jemalloc, tcmalloc); `keep_freed_memory`
gets the same from glibc's own malloc.
"""
from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..runtime.model_runner import ForwardTuning

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_GEMM_ROWS", "PackedLinear", "keep_freed_memory", "pack_linear_layers", "prepare_for_cpu", "real_tokens", "row_bucket",
    "use_grouped_query_attention",
]

CPU_ATTENTION = "adafuse_cpu_sdpa"

# CPU BLAS runs a matmul of 2 or 3 rows as separate matrix-vector products (2-3x the time of one row, more
# than 4 rows take), so small products are padded up to 4 rows.
MIN_GEMM_ROWS = 4

# Up to this many query tokens per row, attention runs as grouped matmuls rather than SDPA (see _few_query_attention).
_GROUPED_MATMUL_MAX_QUERIES = 32

# glibc `mallopt` parameters: blocks up to 32 MB (the most glibc allows) come from the heap, not `mmap`, and up to
# 256 MiB of freed heap stay with the process for the next step instead of going back to the system.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BLOCK_LIMIT, _KEPT_FREE_MEMORY = 32 << 20, 256 << 20
_freed_memory_kept = False


@dataclass
class _RealTokens:
    """The forward's real tokens while `real_tokens` is active: how many positions it has, the flat indices of the
    real ones, and the batch x width mask."""

    positions: int
    index: torch.Tensor
    mask: torch.Tensor

    @cached_property
    def right_aligned_counts(self) -> list[int] | None:
        """Real tokens per row if each row's are its last ones (a padded prompt batch), else None; every layer of a
        forward asks, so it is worked out once."""
        counts = self.mask.sum(1).tolist()
        width = self.mask.shape[1]
        aligned = all(bool(self.mask[r, width - count:].all()) for r, count in enumerate(counts))
        return counts if aligned else None


_REAL_TOKENS: ContextVar[_RealTokens | None] = ContextVar("adafuse_real_tokens", default=None)


@contextmanager
def real_tokens(real: torch.Tensor) -> Iterator[None]:
    """Within this block, packed linear layers compute only the positions where `real` (batch x width, bool)
    is True and give zeros at padding, and long padded prompts attend row by row over their real queries only.
    Linear layers act on each position alone, and padding is masked from real tokens, so real positions are
    unchanged; a padded batch of rows with uneven numbers of new tokens stops paying for its padding."""
    flat = real.flatten()
    index = flat.nonzero().flatten()
    if len(index) < MIN_GEMM_ROWS:
        index = torch.cat([index, (~flat).nonzero().flatten()[: MIN_GEMM_ROWS - len(index)]]).sort().values
    token = _REAL_TOKENS.set(_RealTokens(flat.numel(), index, real) if len(index) < flat.numel() else None)
    try:
        yield
    finally:
        _REAL_TOKENS.reset(token)


class PackedLinear(nn.Module):
    """Drop-in for a frozen `nn.Linear` on CPU: the same `weight` (still shared with tied embeddings, still in
    the state dict) plus its oneDNN-packed copy that inference runs on. `bucket_rows` (default True) pads row
    counts to their `row_bucket`."""

    bucket_rows = True

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (inputs.requires_grad or self.weight.requires_grad):
            return nn.functional.linear(inputs, self.weight, self.bias)  # the packed op has no backward
        bias = None if self.bias is None else self.bias.detach()
        flat = inputs.reshape(-1, self.in_features)
        subset = _REAL_TOKENS.get()
        if subset is None or flat.shape[0] != subset.positions:
            return self._product(flat, bias).view(*inputs.shape[:-1], self.out_features)
        positions = subset.index
        real = self._product(flat.index_select(0, positions), bias)
        output = inputs.new_zeros((*inputs.shape[:-1], self.out_features))
        output.view(-1, self.out_features).index_copy_(0, positions, real)
        return output

    def _product(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The packed product of a rows x in_features matrix, its rows padded up to their `row_bucket`."""
        rows = flat.shape[0]
        padded = row_bucket(rows) if self.bucket_rows else rows
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def row_bucket(rows: int) -> int:
    """`rows` rounded up to one of eight sizes per doubling (at most 1/8 more rows) above 16.

    oneDNN builds and caches a kernel per input shape; with every prompt length a new shape, the cache (up to
    1024 kernels and their scratch memory) kept growing a process by hundreds of MB. Bucketed, a model needs
    at most 16 + 8 per doubling shapes per layer size, whatever the prompts.
    """
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` for a `PackedLinear`; return how many were swapped.

    Does nothing (returns 0) off CPU, for other dtypes, or where this PyTorch build lacks the oneDNN ops or
    gives a different product on a probe.
    """
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    eligible = [(n, m) for n, m in linears if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not eligible or not _packing_works():
        return 0
    for name, linear in eligible:
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attribute, PackedLinear(linear))
    logger.info("packed %d linear layers for oneDNN", len(eligible))
    return len(eligible)


def _packing_works() -> bool:
    try:
        weight, inputs = torch.randn(24, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        product = torch.ops.mkldnn._linear_pointwise(inputs, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return torch.allclose(product, inputs @ weight.T, atol=1e-5)


def _grouped_query_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with key/value heads shared through `enable_gqa` instead of copied."""
    if any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux")) or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if attention_mask is not None and query.shape[2] <= _GROUPED_MATMUL_MAX_QUERIES and attention_mask.shape[1] == 1 \
            and not torch.is_grad_enabled():
        return _few_query_attention(query, key, value, attention_mask, scaling), None
    enable_gqa = getattr(module, "num_key_value_groups", 1) > 1
    queries = _right_aligned_queries(query.shape[0], query.shape[2])
    if attention_mask is not None and queries is not None and not torch.is_grad_enabled():
        output = query.new_zeros(query.shape)
        for r, count in enumerate(queries):
            if count:
                end = query.shape[2]
                output[r:r + 1, :, end - count:] = torch.nn.functional.scaled_dot_product_attention(
                    query[r:r + 1, :, end - count:], key[r:r + 1], value[r:r + 1],
                    attn_mask=attention_mask[r:r + 1, :, end - count:], scale=scaling, enable_gqa=enable_gqa,
                )
        return output.transpose(1, 2).contiguous(), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and is_causal),
        enable_gqa=enable_gqa,
    )
    return output.transpose(1, 2).contiguous(), None


def _right_aligned_queries(batch: int, width: int) -> list[int] | None:
    """Real queries per row when a padded prompt batch (`real_tokens`, suffixes right-aligned) is mostly padding,
    so attention runs row by row over them; None otherwise (one padded call is cheaper)."""
    subset = _REAL_TOKENS.get()
    if subset is None or subset.mask.shape != (batch, width) or len(subset.index) > 0.75 * batch * width:
        return None
    return subset.right_aligned_counts


def _few_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         scaling: float | None) -> torch.Tensor:
    """Attention for a few new tokens per row over a long cache: the query heads that share a key/value head are
    stacked into one matrix, so each direction is a single batched matmul over the cache, read once.

    SDPA's CPU kernels are tuned for long queries; for decoding steps (1-32 queries per row over hundreds to
    thousands of cached columns) this is 1.3-2x faster, with the same result (float32 softmax).
    """
    batch, heads, tokens, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scores = query.reshape(batch, kv_heads, groups * tokens, dim) @ key.transpose(-1, -2)
    scores = scores.view(batch, kv_heads, groups, tokens, length) * (scaling or dim ** -0.5)
    mask = mask[:, :, None, :, :length]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    probabilities = scores.softmax(-1).view(batch, kv_heads, groups * tokens, length)
    return (probabilities @ value).view(batch, heads, tokens, dim).transpose(1, 2).contiguous()


def use_grouped_query_attention(model: PreTrainedModel) -> bool:
    """Switch a CPU model running transformers' SDPA attention to the copy-free grouped-query version (registered
    with transformers at the first call)."""
    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(CPU_ATTENTION, _grouped_query_sdpa)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    model.set_attn_implementation(CPU_ATTENTION)
    return True


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (process-wide, once), so per-step buffers of tens of MB are
    not faulted in afresh at every forward. Returns whether the setting is in place; False off glibc."""
    global _freed_memory_kept
    if not _freed_memory_kept and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        _freed_memory_kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK_LIMIT)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _KEPT_FREE_MEMORY))
        logger.info("glibc malloc keeps freed memory: %s", _freed_memory_kept)
    return _freed_memory_kept


def prepare_for_cpu(model: PreTrainedModel) -> ForwardTuning:
    """Apply this module's kernels to a model that stays frozen, and return what its forwards must then do (nothing
    off CPU, where no kernel applies)."""
    packed = pack_linear_layers(model)
    if not (use_grouped_query_attention(model) or packed):
        return ForwardTuning()
    keep_freed_memory()
    return ForwardTuning(MIN_GEMM_ROWS, real_tokens)
