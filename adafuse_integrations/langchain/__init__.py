"""LangChain backends: the fused model as a completion LLM (`AdaFuseLLM`) and as a chat model (`ChatAdaFuse`)."""
from .chat_models import ChatAdaFuse
from .llms import AdaFuseLLM

__all__ = ["AdaFuseLLM", "ChatAdaFuse"]
