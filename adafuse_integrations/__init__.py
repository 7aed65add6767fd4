"""Framework adapters for the AdaFuse engine: `adafuse_integrations.langchain` and `adafuse_integrations.llama_index`."""
