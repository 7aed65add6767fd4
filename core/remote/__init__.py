"""Served models as ensemble members: a backend over an OpenAI-compatible completions server (vLLM, SGLang)."""
from .backend import RemoteBackend
from .client import BackendError, CompletionsClient
from .launch import VLLMServer

__all__ = ["BackendError", "CompletionsClient", "RemoteBackend", "VLLMServer"]
