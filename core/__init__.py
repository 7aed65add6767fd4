"""adafuse: adaptive word-level ensemble decoding of local language models (AdaFuse, arXiv 2601.06022)."""
from ._threads import bound_openmp_spinning

bound_openmp_spinning()

from .backend import Backend, ModelBackend
from .chat import Chat
from .config import DecodingMode, FusionConfig, SamplingFilter
from .fusion import AdaFuse, FusionGate
from .models import DEFAULT_MODELS, ModelLoadError, load_model, prepare_default_models
from .remote import BackendError, RemoteBackend
from .result import CandidateTrace, DecodingStats, GenerationResult, RoundTrace
from .sampling import SequenceAdapter, TokenAdapter

__all__ = [
    "AdaFuse",
    "Backend",
    "BackendError",
    "CandidateTrace",
    "Chat",
    "DEFAULT_MODELS",
    "DecodingMode",
    "DecodingStats",
    "FusionConfig",
    "FusionGate",
    "GenerationResult",
    "ModelBackend",
    "ModelLoadError",
    "RemoteBackend",
    "RoundTrace",
    "SamplingFilter",
    "SequenceAdapter",
    "TokenAdapter",
    "load_model",
    "prepare_default_models",
]
__version__ = "0.1.0"
