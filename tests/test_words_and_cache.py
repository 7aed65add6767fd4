"""Word boundaries from the vocabulary, and the KV tree against full re-encoding."""
import torch

from adafuse.words import word_start_table
from conftest import full_logprobs

PROMPT = "Question: who wrote the play Hamlet?\nAnswer:"


def test_word_start_table_marks_space_and_newline_tokens(byte_level_tokenizer, metaspace_tokenizer):
    for tokenizer, space, newline in ((byte_level_tokenizer, "Ġwho", "Ċ"), (metaspace_tokenizer, "▁who", "\n")):
        table = word_start_table(tokenizer, len(tokenizer))
        vocab = tokenizer.get_vocab()
        assert table[vocab[space]] and table[vocab[newline]]
        assert not table[vocab["Question" if "Question" in vocab else "Question:"]]
        assert not table[tokenizer.eos_token_id]


def test_tree_logprobs_match_full_reencoding(llama_backend, gemma_backend):
    for backend in (llama_backend, gemma_backend):
        prompt = backend.encode_prompt(PROMPT * 2)  # longer than the tiny Gemma's sliding window of 8
        span_a = backend.encode_piece(" William Shakespeare")
        span_b = backend.encode_piece(" Paris")
        batch = backend.start([prompt])
        assert torch.allclose(batch.root_logprobs[0], full_logprobs(backend, prompt), atol=1e-4)
        batch.ensure_paths([[span_a, span_b]])
        for span in (span_a, span_b):
            for i, node in enumerate(batch.path_nodes(0, span)):
                expected = full_logprobs(backend, prompt + span[: i + 1])
                assert torch.allclose(batch.logprobs(0, node), expected, atol=1e-4)
        batch.commit([span_a])
        assert batch.rows[0].ids == prompt + span_a
        assert torch.allclose(batch.root_logprobs[0], full_logprobs(backend, prompt + span_a), atol=1e-4)
        batch.ensure_paths([[span_b]])
        node = batch.path_nodes(0, span_b)[-1]
        assert torch.allclose(batch.logprobs(0, node), full_logprobs(backend, prompt + span_a + span_b), atol=1e-4)


def test_batched_rows_with_padding_match_single_rows(gemma_backend):
    prompts = [gemma_backend.encode_prompt(PROMPT), gemma_backend.encode_prompt("The quick brown fox")]
    span = gemma_backend.encode_piece(" jumps over")
    batch = gemma_backend.start(prompts)
    batch.ensure_paths([[span], [span]])
    for r, prompt in enumerate(prompts):
        node = batch.path_nodes(r, span)[-1]
        assert torch.allclose(batch.logprobs(r, node), full_logprobs(gemma_backend, prompt + span), atol=1e-4)
    batch.commit([None, span])
    assert len(batch.rows) == 1
    assert torch.allclose(batch.root_logprobs[0], full_logprobs(gemma_backend, prompts[1] + span), atol=1e-4)


def test_shared_prefix_nodes_are_fed_once(llama_backend):
    batch = llama_backend.start([llama_backend.encode_prompt(PROMPT)])
    one = llama_backend.encode_piece(" the quick")
    before = llama_backend.counters["tokens"]
    batch.ensure_paths([[one, one[:1], one]])
    assert llama_backend.counters["tokens"] - before == len(one)
    assert len(batch.rows[0].nodes) == len(one)


def test_shared_prompt_prefix_is_reused_and_exact(llama_backend, gemma_backend):
    for backend in (llama_backend, gemma_backend):
        first = backend.encode_prompt(PROMPT * 2)
        backend.start([first])
        others = [backend.encode_prompt(PROMPT * 2 + " William"), backend.encode_prompt(PROMPT * 2 + "\nQuestion: who")]
        shared = backend.prefix_cache.reusable(others)
        assert shared >= len(first) - 2
        before = backend.counters["tokens"]
        batch = backend.start(others)
        assert backend.counters["tokens"] - before == sum(len(p) for p in others) - 2 * shared
        span = backend.encode_piece(" Shakespeare")
        batch.ensure_paths([[span], [span]])
        for r, prompt in enumerate(others):
            assert torch.allclose(batch.root_logprobs[r], full_logprobs(backend, prompt), atol=1e-4)
            node = batch.path_nodes(r, span)[-1]
            assert torch.allclose(batch.logprobs(r, node), full_logprobs(backend, prompt + span), atol=1e-4)


def test_unrelated_prompt_reuses_nothing(llama_backend):
    llama_backend.start([llama_backend.encode_prompt(PROMPT * 2)])
    assert llama_backend.prefix_cache.reusable([llama_backend.encode_prompt("The quick brown fox jumps")]) == 0
