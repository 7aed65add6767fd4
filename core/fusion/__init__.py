"""Word-level ensemble decoding (AdaFuse, arXiv 2601.06022): the engine, its rounds, proposals, scoring and gate."""
from .engine import AdaFuse
from .gate import FusionGate, GateDecision, GateSession

__all__ = ["AdaFuse", "FusionGate", "GateDecision", "GateSession"]
