"""HTTP to an OpenAI-compatible server (vLLM, SGLang): pooled async requests sent side by side, a deadline on every
attempt, retries with backoff where a retry is safe, and one error type that names the server."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import httpx

logger = logging.getLogger(__name__)

__all__ = ["BackendError", "CompletionsClient"]

# Statuses a retry can cure: overload, a restarting server, a gateway in between. Every request this package sends
# is a pure read (greedy scoring, no side effects), so retrying one is always safe.
_RETRIED_STATUS = {408, 429, 500, 502, 503, 504}


class BackendError(RuntimeError):
    """A served model did not answer; the message names the server and what went wrong."""


class CompletionsClient:
    """Requests to one server, from any thread: `post_many` sends a list of bodies concurrently over a pooled
    connection set and returns the decoded answers in order, or raises `BackendError`.

    Requests run on an event loop in a daemon thread of their own, so synchronous callers (the decoding loop, a
    worker thread of a stream) share one pool.
    """

    def __init__(self, base_url: str, *, timeout: float = 60.0, retries: int = 2, backoff: float = 0.5,
                 max_connections: int = 64, api_key: str | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"invalid server url {base_url!r}: expected http(s)://host:port/v1")
        if timeout <= 0 or retries < 0:
            raise ValueError(f"invalid timeout={timeout} or retries={retries}: need timeout > 0 and retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"adafuse-http {self.base_url}", daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = self._run(self._make_client(headers, limits))

    async def _make_client(self, headers: dict[str, str], limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)))

    def _run(self, coroutine: Any) -> Any:
        if self._loop.is_closed():
            coroutine.close()
            raise BackendError(f"model server {self.base_url}: the client was closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def get(self, path: str) -> Any:
        """GET `path` (relative to the base url, or absolute from the host with a leading '//')."""
        return self._run(self._request("GET", path, None))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.post_many(path, [body])[0]

    def post_many(self, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
        """POST every body to `path` at once; the answers in order. The first failure raises (the rest are dropped)."""
        if not bodies:
            return []

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(self._request("POST", path, body) for body in bodies)))

        return self._run(gather())

    def url(self, path: str) -> str:
        """`path` under the base url; `//path` under the server's root (for routes outside /v1, such as /tokenize)."""
        if path.startswith("//"):
            root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
            return root + path[1:]
        return f"{self.base_url}/{path.lstrip('/')}"

    async def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        url = self.url(path)
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await asyncio.wait_for(self._client.request(method, url, json=body), self.timeout)
            except (httpx.TransportError, asyncio.TimeoutError) as error:
                reason = "timed out" if isinstance(error, (asyncio.TimeoutError, httpx.TimeoutException)) else \
                    f"connection failed ({error.__class__.__name__}: {error})"
                if last:
                    raise BackendError(f"model server {self.base_url}: {method} {url} {reason} after "
                                       f"{attempt + 1} attempt(s) (timeout {self.timeout:g} s each)") from error
            else:
                if response.status_code < 400:
                    return _json(response, self.base_url)
                if response.status_code not in _RETRIED_STATUS or last:
                    raise BackendError(f"model server {self.base_url}: {method} {url} answered HTTP "
                                       f"{response.status_code}: {_server_message(response)}")
            delay = self.backoff * 2 ** attempt
            logger.info("retrying %s %s in %.1f s (attempt %d failed)", method, url, delay, attempt + 1)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connections and stop the loop thread; later calls raise `BackendError`."""
        if self._loop.is_closed():
            return
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


def _json(response: httpx.Response, server: str) -> Any:
    try:
        return response.json()
    except json.JSONDecodeError as error:
        raise BackendError(f"model server {server}: {response.request.url} answered with invalid JSON "
                           f"({response.text[:200]!r})") from error


def _server_message(response: httpx.Response) -> str:
    """The error text an OpenAI-compatible server puts in its body ({"error": {"message": ...}} or {"message": ...})."""
    try:
        body = response.json()
    except json.JSONDecodeError:
        return response.text[:300] or response.reason_phrase
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:300]
