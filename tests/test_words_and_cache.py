"""Word boundaries from the vocabulary, and the KV tree against full re-encoding."""
import platform
import subprocess
import sys

import pytest
import torch

from adafuse.runtime import CachedPrompt, ModelRunner, OutputHead, PromptPrefixCache, prefill
from adafuse.kernels.cpu import CPU_ATTENTION, PackedLinear, _right_aligned_queries, pack_linear_layers, prepare_for_cpu, real_tokens
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


def test_long_padded_prompts_attend_row_by_row_and_match_single_rows(llama_backend, gemma_backend):
    for backend in (llama_backend, gemma_backend):
        backend.prefix_cache.entries.clear()
        prompts = [backend.encode_prompt(PROMPT * 4), backend.encode_prompt("The quick brown fox")]
        width = max(len(p) for p in prompts)
        real = torch.zeros((2, width), dtype=torch.bool)
        for r, prompt in enumerate(prompts):
            real[r, width - len(prompt):] = True
        with real_tokens(real):
            assert _right_aligned_queries(2, width) == [len(p) for p in prompts]  # mostly padding: row by row
        batch = backend.start(prompts)
        for r, prompt in enumerate(prompts):
            assert torch.allclose(batch.root_logprobs[r], full_logprobs(backend, prompt), atol=1e-4)


def test_rows_commit_and_compact_while_other_rows_hold_trees(llama_backend, gemma_backend):
    for backend in (llama_backend, gemma_backend):
        prompts = [backend.encode_prompt(PROMPT * 2), backend.encode_prompt("The quick brown fox")]
        span, other = backend.encode_piece(" jumps over"), backend.encode_piece(" the lazy dog")
        batch = backend.start(prompts)
        batch.ensure_paths([[span, other], [other]])  # row 0: two branches; row 1: one, still in flight
        batch.commit_row(0, span)
        width = batch.committed.shape[1]
        batch.compact(force=True)  # row 0's dead branch goes; row 1's tree is renumbered, not lost
        assert batch.committed.shape[1] < width
        joining = backend.start([backend.encode_prompt("A much longer prompt that makes the joining cache wider " * 3)])
        batch.extend(joining)  # left-pads the running rows, trees included
        buffers = [layer._key_buffer.data_ptr() for layer in batch.cache.layers]
        batch.ensure_paths([[other], [other + span], [span]])
        assert [layer._key_buffer.data_ptr() for layer in batch.cache.layers] == buffers  # appended in place
        expected = [prompts[0] + span + other, prompts[1] + other + span, joining.rows[0].ids + span]
        for r, path in enumerate(([other], [other + span], [span])):
            node = batch.path_nodes(r, path[0])[-1]
            assert torch.allclose(batch.logprobs(r, node), full_logprobs(backend, expected[r]), atol=1e-4)


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
        shared = [backend.prefix_cache.match(p)[1] for p in others]
        assert min(shared) >= len(first) - 2
        before = backend.counters["tokens"]
        batch = backend.start(others)
        assert backend.counters["tokens"] - before == sum(len(p) for p in others) - sum(shared)
        span = backend.encode_piece(" Shakespeare")
        batch.ensure_paths([[span], [span]])
        for r, prompt in enumerate(others):
            assert torch.allclose(batch.root_logprobs[r], full_logprobs(backend, prompt), atol=1e-4)
            node = batch.path_nodes(r, span)[-1]
            assert torch.allclose(batch.logprobs(r, node), full_logprobs(backend, prompt + span), atol=1e-4)
        # rows with reused prefixes go on through a commit, a compaction and a wider prompt joining
        batch.commit_row(0, span)
        batch.compact(force=True)
        joining = backend.start([first + backend.encode_piece(" and then a much longer question about the play" * 2)])
        batch.extend(joining)
        batch.ensure_paths([[span], [span], [span]])
        expected = [others[0] + span + span, others[1] + span, joining.rows[0].ids + span]
        for r, tokens in enumerate(expected):
            node = batch.path_nodes(r, span)[-1]
            assert torch.allclose(batch.logprobs(r, node), full_logprobs(backend, tokens), atol=1e-4)


def test_unrelated_prompt_reuses_nothing(llama_backend):
    llama_backend.start([llama_backend.encode_prompt(PROMPT * 2)])
    assert llama_backend.prefix_cache.match(llama_backend.encode_prompt("The quick brown fox jumps")) == (None, 0)


def test_rows_reuse_different_cached_prompts_and_stay_exact(llama_backend, gemma_backend):
    for backend in (llama_backend, gemma_backend):
        hamlet, paris = backend.encode_prompt(PROMPT * 3), backend.encode_prompt("Context: Paris is the capital of France. " * 4)
        backend.start([hamlet, paris])  # a batch caches every row's prompt
        prompts = [paris + backend.encode_piece(" Question: what is it?"), backend.encode_prompt("The quick brown fox"),
                   hamlet + backend.encode_piece(" William")]
        assert [backend.prefix_cache.match(p)[1] for p in prompts] == [len(paris), 0, len(hamlet)]
        before = backend.counters["tokens"]
        batch = backend.start(prompts)
        assert backend.counters["tokens"] - before == sum(len(p) for p in prompts) - len(paris) - len(hamlet)
        span = backend.encode_piece(" and")
        batch.ensure_paths([[span]] * len(prompts))
        for r, prompt in enumerate(prompts):
            assert torch.allclose(batch.root_logprobs[r], full_logprobs(backend, prompt), atol=1e-4)
            assert torch.allclose(batch.logprobs(r, batch.path_nodes(r, span)[-1]), full_logprobs(backend, prompt + span), atol=1e-4)


def test_prompt_cache_keeps_the_newest_entries_and_drops_the_ones_they_extend():
    cache = PromptPrefixCache(max_entries=2)
    for ids in ([1, 2], [1, 2, 3], [7, 8], [9]):
        cache.store(CachedPrompt(ids, []))
    assert [e.ids for e in cache.entries] == [[9], [7, 8]]
    cache.store(CachedPrompt([7, 8, 9], []))
    assert [e.ids for e in cache.entries] == [[7, 8, 9], [9]]
    cache = PromptPrefixCache(max_tokens=4)
    for ids in ([1, 2], [3, 4], [5, 6, 7]):
        cache.store(CachedPrompt(ids, []))
    assert [e.ids for e in cache.entries] == [[5, 6, 7]]


def test_questions_on_one_context_in_a_batch_encode_the_context_once(llama_backend, gemma_backend):
    for backend in (llama_backend, gemma_backend):
        backend.prefix_cache.entries.clear()
        context = backend.encode_prompt("Context: the Seine flows through Paris, the capital of France. " * 8)
        prompts = [context + backend.encode_piece(" Question: which river?"), backend.encode_prompt(PROMPT),
                   context + backend.encode_piece(" Question: which city?")]
        shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[2])) if a != b)
        assert shared >= 64 and backend.prefix_cache.followers(prompts) == [2]
        before = backend.counters["tokens"]
        batch = backend.start(prompts)
        assert backend.counters["tokens"] - before == sum(len(p) for p in prompts) - shared
        assert [row.ids for row in batch.rows] == prompts
        for r, prompt in enumerate(prompts):
            assert torch.allclose(batch.root_logprobs[r], full_logprobs(backend, prompt), atol=1e-4)


def test_output_head_split_is_checked_against_the_full_model(llama_backend):
    head = OutputHead.of(llama_backend.model)
    assert head is not None and head.projection is llama_backend.model.get_output_embeddings()

    class ScaledLogits(torch.nn.Module):  # logits that are not the projection of the decoder's output
        def __init__(self, model):
            super().__init__()
            self.model, self.config, self.device = model, model.config, model.device

        def get_decoder(self):
            return self.model.get_decoder()

        def get_output_embeddings(self):
            return self.model.get_output_embeddings()

        def forward(self, **inputs):
            output = self.model(**inputs)
            output.logits = output.logits * 2
            return output

    assert OutputHead.of(ScaledLogits(llama_backend.model)) is None


def test_scored_prompts_of_one_batch_share_their_prefix_when_the_cache_kept_no_nll(llama_backend):
    """A cached prompt without token NLLs cannot serve a scored prefill, so rows that share a long prefix must still
    follow one another in the batch instead of each encoding it in full."""
    prefix = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
    prompts = [llama_backend.encode_prompt(prefix + q) for q in ("Paris is", "In 1969 the first")]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared > 100
    kept = llama_backend.prefix_cache
    try:
        llama_backend.prefix_cache = PromptPrefixCache()
        llama_backend.start([prompts[0][: shared - 2]])  # cached without NLLs
        llama_backend.reset_counters()
        batch = llama_backend.start(prompts, scored=[[True] * len(p) for p in prompts])
        tokens = llama_backend.reset_counters()["tokens"]
    finally:
        llama_backend.prefix_cache = kept
    assert tokens == len(prompts[0]) + len(prompts[1]) - shared
    unknown = [[i for i, value in enumerate(row.prompt_nll) if value != value] for row in batch.rows]
    assert unknown[0] == [0] and set(unknown[1]) <= {0, shared}  # the first token, and the one after the reused part


def test_tree_without_split_head_matches_full_reencoding(gemma_backend):
    prompts = [gemma_backend.encode_prompt(PROMPT), gemma_backend.encode_prompt("The quick brown fox")]
    span = gemma_backend.encode_piece(" jumps over")
    split = gemma_backend.start(prompts, keep_hidden=True)
    whole = prefill(ModelRunner(gemma_backend.model, {"forward_passes": 0, "tokens": 0}), prompts,
                    gemma_backend.pad_token_id, keep_hidden=True)
    for batch in (split, whole):
        batch.ensure_paths([[span], [span[:1]]])
    assert split.runner.head is not None and whole.runner.head is None
    for r, prompt in enumerate(prompts):
        assert torch.allclose(whole.root_logprobs[r], full_logprobs(gemma_backend, prompt), atol=1e-4)
        assert torch.allclose(whole.root_hidden[r], split.root_hidden[r], atol=1e-5)
        tokens = span if r == 0 else span[:1]
        node = whole.path_nodes(r, tokens)[-1]
        assert torch.allclose(whole.logprobs(r, node), full_logprobs(gemma_backend, prompt + tokens), atol=1e-4)
        assert torch.allclose(whole.rows[r].node_hidden[node], split.rows[r].node_hidden[node], atol=1e-5)


def test_packed_linear_layers_give_the_same_logits(byte_level_tokenizer):
    from conftest import _llama

    plain, packed = _llama(byte_level_tokenizer, seed=3), _llama(byte_level_tokenizer, seed=3)
    head_weight = packed.get_output_embeddings().weight
    assert pack_linear_layers(packed) == sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert isinstance(packed.get_output_embeddings(), PackedLinear)
    assert packed.get_output_embeddings().weight is head_weight  # the same parameter (ties and state dict kept)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.inference_mode():
        assert torch.allclose(plain(ids).logits, packed(ids).logits, atol=1e-4)
    loss = packed(ids, labels=ids).loss  # with gradients on, the dense weight is used, so training still works
    loss.backward()
    assert packed.get_output_embeddings().weight.grad is not None


def test_packed_linear_computes_only_real_tokens_when_asked():
    from adafuse.kernels.cpu import real_tokens

    linear = torch.nn.Linear(16, 24)
    packed = PackedLinear(linear)
    inputs = torch.randn(3, 5, 16)
    real = torch.zeros(3, 5, dtype=torch.bool)
    real[0, :2], real[1, :5], real[2, :1] = True, True, True
    with torch.inference_mode(), real_tokens(real):
        output = packed(inputs)
        other_shape = packed(inputs[:, :2])  # a differently shaped input (an output head on picked rows) is untouched
    assert torch.allclose(output[real], linear(inputs)[real], atol=1e-5)
    assert not output[~real].any()
    assert torch.allclose(other_shape, linear(inputs[:, :2]), atol=1e-5)


def test_cpu_kernels_give_the_same_logits_with_tree_masks(metaspace_tokenizer):
    from conftest import _gemma

    plain, fast = _gemma(metaspace_tokenizer, seed=4), _gemma(metaspace_tokenizer, seed=4)
    prepare_for_cpu(fast)
    assert fast.config._attn_implementation == CPU_ATTENTION  # grouped-query attention (4 heads, 1 KV head)
    ids = torch.tensor([[2, 7, 11, 5, 9, 30, 12, 4, 8, 19, 3, 6]])
    allowed = torch.ones(12, 12).tril().bool()
    allowed[8:, 5:8] = False  # a tree mask: the last tokens skip a sibling branch
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.inference_mode():
        for attention_mask in (None, {"full_attention": mask, "sliding_attention": mask}):
            assert torch.allclose(plain(ids, attention_mask=attention_mask).logits,
                                  fast(ids, attention_mask=attention_mask).logits, atol=1e-4)


_FAULTS_OF_REPEATED_STEPS = """
import resource, torch
from adafuse.kernels.cpu import keep_freed_memory
kept = keep_freed_memory()
def step():  # 24 MB blocks, the size of a batched step's log-distributions over Gemma's vocabulary
    return [torch.ones(6_000_000) for _ in range(3)]
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")
def test_freed_step_buffers_are_reused_without_faulting_pages_in_again():
    output = subprocess.run([sys.executable, "-c", _FAULTS_OF_REPEATED_STEPS], capture_output=True, text=True,
                            check=True).stdout.split()
    pages_per_run = 5 * 3 * 24_000_000 // 4096  # every page of every block, if each step faulted its blocks in afresh
    assert output[0] == "True"
    assert int(output[1]) < pages_per_run // 4
