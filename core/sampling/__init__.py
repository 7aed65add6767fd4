"""Sampling: distribution filters, learned decoding policies (arXiv 2603.09065) and the adaptive sampler."""
from .adaptive import AdaptiveSampler, Rollout, majority_answer, majority_index, prompt_embeddings
from .filters import filtered_probs
from .policies import SHIPPED, DecodingPolicy, PolicyCache, SequenceAdapter, TokenAdapter, next_token_features

__all__ = ["SHIPPED", "AdaptiveSampler", "DecodingPolicy", "PolicyCache", "Rollout", "SequenceAdapter", "TokenAdapter",
           "filtered_probs", "majority_answer", "majority_index", "next_token_features", "prompt_embeddings"]
