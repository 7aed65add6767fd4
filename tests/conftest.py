"""Tiny randomly initialised models with two different tokenizers, built in-process (no downloads)."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from adafuse import AdaFuse, FusionConfig, ModelBackend

CORPUS = [
    "Question: who wrote the play Hamlet?\nAnswer: William Shakespeare",
    "Question: what is the capital of France?\nAnswer: Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "In 1969 the first humans walked on the moon, and 2002 was a good year for football.",
    "Adaptive ensemble decoding fuses several language models at the level of whole words.",
] * 20


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE (Ġ marks a leading space), like SmolLM2's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece style BPE (▁ marks a leading space) that adds a BOS token, like Gemma's."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("▁", behavior="merged_with_next"), pre_tokenizers.Split("\n", behavior="isolated")]
    )
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " ")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  initial_alphabet=list("▁\n?.,:0123456789"))
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>", unk_token="<unk>")


def _llama(tokenizer: PreTrainedTokenizerFast, seed: int, positions: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def _gemma(tokenizer: PreTrainedTokenizerFast, seed: int, positions: int = 512) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=positions,
                              sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id)
    return Gemma3ForCausalLM(config).eval()


def _sharpen(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Scale the output head so a random model has confident (large-margin) next-token distributions."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model


@pytest.fixture(scope="session")
def byte_level_tokenizer():
    return _byte_level_tokenizer()


@pytest.fixture(scope="session")
def metaspace_tokenizer():
    return _metaspace_tokenizer()


@pytest.fixture(scope="session")
def llama_backend(byte_level_tokenizer) -> ModelBackend:
    return ModelBackend(_llama(byte_level_tokenizer, seed=0), byte_level_tokenizer, name="tiny-llama", cpu_kernels=True)


@pytest.fixture(scope="session")
def gemma_backend(metaspace_tokenizer) -> ModelBackend:
    return ModelBackend(_gemma(metaspace_tokenizer, seed=1), metaspace_tokenizer, name="tiny-gemma", cpu_kernels=True)


@pytest.fixture(scope="session")
def third_backend(byte_level_tokenizer) -> ModelBackend:
    return ModelBackend(_sharpen(_llama(byte_level_tokenizer, seed=2), 40.0), byte_level_tokenizer, name="tiny-llama-sharp", cpu_kernels=True)


@pytest.fixture(scope="session")
def long_pair(byte_level_tokenizer, metaspace_tokenizer) -> AdaFuse:
    """The tiny pair with windows that hold tool descriptions (prompts of ~600 tokens)."""
    return AdaFuse([ModelBackend(_llama(byte_level_tokenizer, 0, positions=2048), byte_level_tokenizer, name="tiny-llama", cpu_kernels=True),
                    ModelBackend(_gemma(metaspace_tokenizer, 1, positions=2048), metaspace_tokenizer, name="tiny-gemma", cpu_kernels=True)],
                   FusionConfig(max_new_tokens=8))


@pytest.fixture()
def pair(llama_backend, gemma_backend) -> AdaFuse:
    return AdaFuse([llama_backend, gemma_backend], FusionConfig(max_new_tokens=12))


def full_logprobs(backend: ModelBackend, ids: list[int]) -> torch.Tensor:
    """Next-token log-probabilities from re-encoding `ids` from scratch, with no cache."""
    with torch.no_grad():
        logits = backend.model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)
