"""Running models: KV caches with scratch token trees, prefill with prompt-prefix reuse, continuous batching."""
from .model_runner import ForwardTiming, ForwardTuning, ModelRunner, OutputHead
from .prefill import prefill
from .prefix_cache import CachedPrompt, PromptPrefixCache
from .token_tree import Node, Row, TokenTree
from .tree_batch import TreeBatch

__all__ = ["CachedPrompt", "ForwardTiming", "ForwardTuning", "ModelRunner", "Node", "OutputHead", "PromptPrefixCache",
           "Row", "TokenTree", "TreeBatch", "prefill"]
