"""A stand-in for vLLM's OpenAI-compatible server, run as its own process over a model folder on loopback. It speaks
the parts of the protocol RemoteBackend uses (/v1/models, /tokenize, /v1/completions with token-id prompts,
logprobs, prompt_logprobs, allowed_token_ids, return_tokens_as_token_ids) and takes faults on demand (/fault)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class FakeServer:
    """Starts the stand-in for the model in `folder`, served as `name`; `stop()` kills it, `start()` starts it again
    on the same port. `fault(fail_next=n)` answers the next n completions with HTTP 503, `fault(hang_s=s)` delays
    every completion, `fault(die_after=n)` makes the process exit, as in a crash, after n more completions."""

    def __init__(self, folder: str, name: str, max_logprobs: int = 20):
        self.folder, self.name, self.max_logprobs = folder, name, max_logprobs
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self._process = subprocess.Popen([sys.executable, __file__, self.folder, self.name, str(self.port), str(self.max_logprobs)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the stand-in server exited with {self._process.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the stand-in server did not come up in 60 s")

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()

    def fault(self, **settings) -> None:
        httpx.post(f"http://127.0.0.1:{self.port}/fault", json=settings, timeout=5).raise_for_status()

    def stats(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=5).json()


class _State:
    def __init__(self, folder: str, name: str, max_logprobs: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.name, self.max_logprobs = name, max_logprobs
        self.fail_next, self.hang_s, self.die_after = 0, 0.0, None
        self.completions, self.in_flight, self.max_in_flight = 0, 0, 0
        self.lock = threading.Lock()
        self.engine = ThreadPoolExecutor(max_workers=1)  # one engine thread, as a real server has

    def logprobs(self, ids: list[int]):
        def forward():
            with self.torch.no_grad():
                return self.torch.log_softmax(self.model(self.torch.tensor([ids])).logits[0].float(), dim=-1)
        return self.engine.submit(forward).result()

    def complete(self, body: dict) -> tuple[int, dict]:
        ids, k = body["prompt"], body.get("logprobs") or 0
        if k > self.max_logprobs:
            return 400, {"error": {"message": f"Requested sample logprobs of {k}, which is greater than max allowed: "
                                              f"{self.max_logprobs}", "code": 400}}
        if not isinstance(ids, list) or not ids:
            return 400, {"error": {"message": "prompt must be a non-empty list of token ids", "code": 400}}
        rows = self.logprobs(ids)
        last = rows[-1]
        allowed = body.get("allowed_token_ids")
        token = allowed[0] if allowed else int(last.argmax())
        top = last.topk(min(k, last.numel()))
        choice = {"index": 0, "text": self.tokenizer.decode([token]), "finish_reason": "length", "logprobs": {
            "tokens": [f"token_id:{token}"], "token_logprobs": [float(last[token])],
            "top_logprobs": [{f"token_id:{i}": float(v) for i, v in zip(top.indices.tolist(), top.values.tolist())}]}}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": float(rows[p][t]), "rank": 1}} for p, t in enumerate(ids[1:])]
        return 200, {"object": "text_completion", "model": self.name, "choices": [choice]}


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # a step's requests arrive together
    allow_reuse_address = True
    daemon_threads = True


def _handler(state: _State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body go out separately

        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": state.name, "object": "model", "max_model_len": 256}]})
            elif self.path == "/health":
                self._send(200, {})
            elif self.path == "/stats":
                self._send(200, {"completions": state.completions, "max_in_flight": state.max_in_flight})
            else:
                self._send(404, {"error": {"message": "Not Found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/fault":
                for key, value in body.items():
                    setattr(state, key, value)
                self._send(200, {})
            elif self.path == "/tokenize":
                ids = state.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
                self._send(200, {"tokens": ids, "count": len(ids)})
            elif self.path == "/v1/completions":
                self._complete(body)
            else:
                self._send(404, {"error": {"message": "Not Found"}})

        def _complete(self, body: dict) -> None:
            with state.lock:
                if state.fail_next > 0:
                    state.fail_next -= 1
                    self._send(503, {"error": {"message": "server is restarting"}})
                    return
                state.completions += 1
                if state.die_after is not None and state.completions > state.die_after:
                    os._exit(1)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                time.sleep(state.hang_s)
                self._send(*state.complete(body))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting
            finally:
                with state.lock:
                    state.in_flight -= 1

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("folder", "name", "port", "max_logprobs"):
        parser.add_argument(name)
    args = parser.parse_args()
    state = _State(args.folder, args.name, int(args.max_logprobs))
    _Server(("127.0.0.1", int(args.port)), _handler(state)).serve_forever()


if __name__ == "__main__":
    main()
