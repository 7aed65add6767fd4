"""The token-level baseline (UniTE-style): each round pools every model's top-k next tokens by their text and
picks the one with the highest weighted mean probability."""
from __future__ import annotations

import torch

from ..backend import Backend
from ..config import FusionConfig
from ..runtime import TokenTree
from .candidates import Candidate, CandidatePool

__all__ = ["token_candidates", "token_scores"]


def token_candidates(backends: list[Backend], batches: list[TokenTree], position: int, config: FusionConfig,
                     may_end: bool = True) -> list[Candidate]:
    """Every model's top-k next tokens for one row, pooled by their text (no end token while `may_end` is False)."""
    pool = CandidatePool()
    for backend, batch in zip(backends, batches):
        logprobs = batch.root_logprobs[position]
        for token in (logprobs if may_end else backend.without_end(logprobs)).topk(config.token_top_k).indices.tolist():
            ends = token in backend.end_ids
            pool.add("" if ends else backend.decode([token]), ends, backend.name)
    return pool.candidates()


def token_scores(backends: list[Backend], batches: list[TokenTree], position: int, pool: list[Candidate],
                 weights: torch.Tensor) -> tuple[list[list[float]], list[float]]:
    """Each model's log-probability of each pooled token text (mapped through its own tokenizer's first token), and
    the fused score: minus the log of the weighted mean probability."""
    nll = []
    for candidate in pool:
        row = []
        for backend, batch in zip(backends, batches):
            logprobs = batch.root_logprobs[position]
            tokens = backend.encode_piece(candidate.text)
            row.append(-float(backend.end_logprob(logprobs) if candidate.ends else logprobs[tokens[0]]))
        nll.append(row)
    fused = [-float(torch.log(torch.exp(-torch.tensor(n)) @ weights)) for n in nll]
    return nll, fused
