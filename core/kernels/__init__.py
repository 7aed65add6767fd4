"""Hardware-specific kernels, applied to a model once at load by an explicit call (never at import)."""
from .cpu import prepare_for_cpu

__all__ = ["prepare_for_cpu"]
