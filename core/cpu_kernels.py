"""Faster CPU kernels for a frozen model: oneDNN-packed linear layers and grouped-query attention without copies.

PyTorch's default CPU matmul (MKL sgemm) is slow for the few-row products decoding runs: on the machines
this project runs on, a 4-row product costs three times a 1-row one, and the 262k-row Gemma output head takes
43 ms per token. oneDNN with the weight reordered once into its blocked layout is 2-4x faster at every row
count (`benchmarks/bench_decoding.py` reports the end-to-end effect). This is the weight prepacking that
`torch.compile` applies on CPU, without compiling.

transformers' SDPA path repeats every key/value head for grouped-query attention whenever a mask is given,
copying the whole KV cache per layer and step; on CPU, SDPA's own `enable_gqa` does the same attention without
the copy (2.5x faster attention for a batch of 8 rows).
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

__all__ = ["PackedLinear", "pack_linear_layers", "prepare_for_cpu", "use_grouped_query_attention"]

CPU_ATTENTION = "adafuse_cpu_sdpa"


class PackedLinear(nn.Module):
    """Drop-in for a frozen `nn.Linear` on CPU: the same `weight` (still shared with tied embeddings, still in
    the state dict) plus its oneDNN-packed copy that inference runs on."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (inputs.requires_grad or self.weight.requires_grad):
            return nn.functional.linear(inputs, self.weight, self.bias)  # the packed op has no backward
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(inputs, self.packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and is_causal),
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(CPU_ATTENTION, _grouped_query_sdpa)
AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)


def use_grouped_query_attention(model: PreTrainedModel) -> bool:
    """Switch a CPU model running transformers' SDPA attention to the copy-free grouped-query version."""
    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(CPU_ATTENTION)
    return True


def prepare_for_cpu(model: PreTrainedModel) -> None:
    """Apply this module's kernels to a model that stays frozen (no-ops off CPU)."""
    pack_linear_layers(model)
    use_grouped_query_attention(model)
