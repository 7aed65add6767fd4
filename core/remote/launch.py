"""Starting a vLLM OpenAI-compatible server for a model folder and stopping it again: for tests, benchmarks and the
cookbook, where a run must bring up its own servers on loopback and leave nothing behind."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from .client import BackendError

logger = logging.getLogger(__name__)

__all__ = ["VLLMServer", "free_port"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VLLMServer:
    """`with VLLMServer(python, folder, "smollm2-135m") as server: server.url` serves the model at `folder` under
    that name on 127.0.0.1, with vLLM installed in the interpreter `python` (its own virtualenv: vLLM pins its own
    torch and transformers). `extra_args` go to the server as given (e.g. ["--tensor-parallel-size", "2"] on GPUs).
    Start-up waits for /health up to `start_timeout` s; a server that exits or never answers raises `BackendError`
    with the end of its log. Its compile cache lives in a temporary folder, removed with the server."""

    def __init__(self, python: str, folder: str, name: str, *, port: int | None = None, dtype: str = "float32",
                 max_model_len: int = 2048, kv_cache_gib: int = 1, start_timeout: float = 900.0,
                 extra_args: list[str] | None = None):
        self.python, self.folder, self.name = python, folder, name
        self.port = port or free_port()
        self.args = ["--model", folder, "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", dtype, "--max-model-len", str(max_model_len), *(extra_args or [])]
        self.kv_cache_gib, self.start_timeout = kv_cache_gib, start_timeout
        self._process: subprocess.Popen | None = None
        self._scratch: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def spec(self) -> str:
        """The model spec that `AdaFuse.from_pretrained` connects to."""
        return f"vllm:{self.url}#{self.name}"

    def start(self) -> "VLLMServer":
        """Launch the server process (without waiting for it: see `wait`)."""
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="adafuse-vllm-")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_CACHE_ROOT": self._scratch.name,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        log = open(self.log_path, "ab")
        try:
            self._process = subprocess.Popen([self.python, "-m", "vllm.entrypoints.openai.api_server", *self.args],
                                             stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            log.close()
        logger.info("started vLLM for %s on port %d (pid %d)", self.name, self.port, self._process.pid)
        return self

    @property
    def log_path(self) -> Path:
        return Path(self._scratch.name) / "server.log"

    def wait(self) -> "VLLMServer":
        """Block until the server answers /health; raise `BackendError` if it exits or the time runs out."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BackendError(f"vLLM server for {self.name!r} exited with code {self._process.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(2)
        self.stop()
        raise BackendError(f"vLLM server for {self.name!r} did not answer /health within {self.start_timeout:g} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """End the server at once (a crash, for fault tests); `start()` brings it back with its cache."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, 9)
            self._process.wait()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s) and remove its scratch folder."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, 15)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def __enter__(self) -> "VLLMServer":
        try:
            return self.start().wait()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
