"""From a model spec to an ensemble member: `vllm:URL#NAME` (or `sglang:`) is a served model, anything else an
embedded name, Hugging Face id or folder loaded in this process."""
from __future__ import annotations

import torch

from .backend import Backend, ModelBackend
from .remote import RemoteBackend

__all__ = ["REMOTE_SCHEMES", "load_backend"]

REMOTE_SCHEMES = ("vllm", "sglang")


def load_backend(spec: str, *, device_map: str | dict | None = None, dtype: str | torch.dtype | None = None,
                 reuse_prompt_prefix: bool = True) -> Backend:
    """`vllm:http://host:8000/v1#gemma3-270m` connects to the model the server serves as `gemma3-270m` (its
    tokenizer loaded here from that name); any other spec loads the model in this process."""
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"a model is given by a non-empty string, not {spec!r}")
    scheme, _, rest = spec.partition(":")
    if scheme not in REMOTE_SCHEMES or not rest.startswith(("http://", "https://")):
        return ModelBackend.from_pretrained(spec, device_map=device_map, dtype=dtype, reuse_prompt_prefix=reuse_prompt_prefix)
    url, _, served = rest.partition("#")
    if not served:
        raise ValueError(f"invalid served model {spec!r}: expected {scheme}:http://host:port/v1#served-model-name")
    return RemoteBackend(url, served, name=spec)
