"""An OpenAI-compatible HTTP server for the fused model (`adafuse serve`; needs the `serve` extra)."""
from __future__ import annotations

from typing import Any

from .app import create_app

__all__ = ["create_app", "serve"]


def serve(engine: Any, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          max_pending: int = 64, max_tokens: int = 256, graceful_shutdown_s: float = 30.0) -> None:
    """Serve `engine` (an `AdaFuse`) until interrupted; on SIGINT or SIGTERM stop taking requests and give those in
    flight up to `graceful_shutdown_s` to finish."""
    import uvicorn

    app = create_app(engine, model_name=model_name, max_pending=max_pending, max_tokens=max_tokens)
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=graceful_shutdown_s, log_level="info")
