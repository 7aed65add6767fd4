"""The AdaFuse round: gate, M-word spans, B-way exploration, cross-tokenizer scoring, stops, N models."""
import pytest
import torch

from adafuse import AdaFuse, FusionConfig
from adafuse.fusion.proposals import propose_row
from adafuse.runtime.scheduler import Scheduler
from adafuse.sampling.adaptive import AdaptiveSampler
from conftest import full_logprobs

PROMPT = "Question: what is the capital of France?\nAnswer:"


def propose(backend, batch, config, budget=50, generator=None):
    """Drive one row's proposal coroutine on its own batch, one forward per request."""
    run = propose_row(backend, batch.root_logprobs[0], None, config, budget, generator)
    try:
        request = next(run)
        while True:
            nodes = batch.feed([request])[0]
            request = run.send((nodes, torch.stack([batch.logprobs(0, n) for n in nodes]), None))
    except StopIteration as done:
        return done.value


def _word_count(backend, tokens):
    return sum(bool(backend.starts_word[t]) for t in tokens[1:]) + 1


def test_confident_model_commits_up_to_m_whole_words(third_backend):
    config = FusionConfig(tau_delta=0.0, max_span_words=3)
    batch = third_backend.start([third_backend.encode_prompt(PROMPT)])
    row = propose(third_backend, batch, config)
    assert not row.explored and len(row.proposals) == 1
    proposal = row.proposals[0]
    assert proposal.ends or _word_count(third_backend, proposal.tokens) == proposal.words
    assert 1 <= proposal.words <= 3
    if not proposal.ends and proposal.words == 3:
        after = batch.logprobs(0, batch.path_nodes(0, proposal.tokens)[-1]).argmax()
        assert third_backend.starts_word[after] or int(after) in third_backend.end_ids


def test_unconfident_model_explores_top_b_first_tokens(llama_backend):
    config = FusionConfig(tau_delta=1.0, num_branches=3)
    batch = llama_backend.start([llama_backend.encode_prompt(PROMPT)])
    row = propose(llama_backend, batch, config)
    assert row.explored
    firsts = [p.tokens[0] for p in row.proposals if p.tokens]
    assert firsts == batch.root_logprobs[0].topk(3).indices.tolist()[: len(firsts)]
    assert all(p.words == 1 for p in row.proposals)
    for p in row.proposals:  # each branch is finished to a whole word: the next greedy token starts a word
        if p.tokens and not p.ends and len(p.tokens) < config.max_word_tokens:
            after = batch.logprobs(0, batch.path_nodes(0, p.tokens)[-1]).argmax()
            assert llama_backend.starts_word[after]


def test_single_branch_disables_exploration(llama_backend):
    batch = llama_backend.start([llama_backend.encode_prompt(PROMPT)])
    row = propose(llama_backend, batch, FusionConfig(tau_delta=1.0, num_branches=1))
    assert len(row.proposals) == 1 and not row.explored


def _one_hot_logprobs(backend, token):
    """Log-scores with `token` first, by a margin below 1 (so below τΔ = 1: never confident)."""
    logprobs = torch.full((backend.vocab_size,), -5.0)
    logprobs[token] = 0.0
    return logprobs


@pytest.mark.parametrize("first", ["Ċ", "Question"])
def test_leading_whitespace_belongs_to_the_next_word(llama_backend, first):
    """A line break alone is not a word: the span goes on through the next word start, and ends at the one after."""
    vocab = llama_backend.tokenizer.get_vocab()
    assert llama_backend.blank[vocab["Ċ"]] and not llama_backend.blank[vocab["Ġwho"]]
    greedy = [vocab["Ġwho"], vocab["Ġthe"]]
    run = propose_row(llama_backend, _one_hot_logprobs(llama_backend, vocab[first]), None,
                      FusionConfig(tau_delta=1.0, num_branches=1), 50)
    run.send(None)
    with pytest.raises(StopIteration) as done:
        for token in greedy:
            run.send(([0], _one_hot_logprobs(llama_backend, token)[None], None))
    assert done.value.value.proposals[0].tokens == ([vocab[first], greedy[0]] if first == "Ċ" else [vocab[first]])


def test_sampling_exploration_draws_distinct_first_tokens(llama_backend):
    batch = llama_backend.start([llama_backend.encode_prompt(PROMPT)])
    config = FusionConfig(tau_delta=1.0, num_branches=3, exploration="sample", top_k=10)
    row = propose(llama_backend, batch, config, generator=torch.Generator().manual_seed(0))
    firsts = [p.tokens[0] for p in row.proposals if p.tokens]
    assert len(set(firsts)) == len(firsts) == 3
    assert set(firsts) <= set(batch.root_logprobs[0].topk(10).indices.tolist())


@pytest.mark.parametrize("normalization", ["token", "char", "total"])
def test_fused_scores_equal_direct_nll(pair, normalization):
    result = pair.generate(PROMPT, trace=True, max_new_tokens=6, tau_delta=1.0, scoring="mean",
                           span_normalization=normalization)
    first = result.trace[0]
    assert len(first.candidates) > 1
    assert set(first.candidates[0].nll) == {"tiny-llama", "tiny-gemma"}
    for candidate in first.candidates:
        for backend in pair.backends:
            prompt = backend.encode_prompt(PROMPT)
            tokens = backend.encode_piece(candidate.text)
            logps = [full_logprobs(backend, prompt + tokens[:i])[t] for i, t in enumerate(tokens)]
            if candidate.ends:
                logps.append(backend.end_logprob(full_logprobs(backend, prompt + tokens)))
            per = {"token": len(logps), "char": len(candidate.text) + candidate.ends, "total": 1}[normalization]
            assert candidate.nll[backend.name] == pytest.approx(-float(sum(logps)) / per, abs=1e-4)
        assert candidate.score == pytest.approx(sum(candidate.nll.values()) / 2, abs=1e-5)
    assert first.chosen == min(first.candidates, key=lambda c: c.score).text


def test_model_weights_change_the_fused_score(pair):
    result = pair.generate(PROMPT, trace=True, max_new_tokens=3, tau_delta=1.0, model_weights=[1.0, 0.0])
    for candidate in result.trace[0].candidates:
        assert candidate.score == pytest.approx(candidate.nll["tiny-llama"], abs=1e-5)


def test_stop_sequence_cuts_text(pair):
    free = pair.generate(PROMPT, max_new_tokens=12)
    assert free.finish_reason in ("length", "eos")
    assert len(free.text) > 2
    stop = free.text[2:4]
    stopped = pair.generate(PROMPT, max_new_tokens=12, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]


def test_stop_sequence_that_never_appears_runs_to_length(pair):
    result = pair.generate(PROMPT, max_new_tokens=8, stop=["@@never@@"])
    assert result.finish_reason in ("length", "eos")
    assert "@@never@@" not in result.text
    assert len(pair.backends[0].encode_piece(result.text)) <= 8


@pytest.mark.parametrize("count", [1, 2, 3])
def test_any_number_of_models(llama_backend, gemma_backend, third_backend, count):
    fuser = AdaFuse([llama_backend, gemma_backend, third_backend][:count], FusionConfig(max_new_tokens=8))
    result = fuser.generate(PROMPT, trace=True)
    assert result.text and result.stats.rounds == len(result.trace) >= 1
    assert set(result.stats.forward_passes) == {b.name for b in fuser.backends}
    assert all(v > 0 for v in result.stats.tokens_processed.values())


def test_single_model_with_open_gate_is_greedy_decoding(llama_backend):
    fuser = AdaFuse([llama_backend], FusionConfig(tau_delta=0.0, max_new_tokens=10))
    result = fuser.generate(PROMPT)
    ids = llama_backend.encode_prompt(PROMPT)
    with torch.no_grad():
        out = llama_backend.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    greedy = llama_backend.decode(out[0, len(ids):].tolist())
    assert result.text == greedy[: len(result.text)] and len(result.text) >= len(greedy) - 8


def test_stream_yields_the_generated_text(pair):
    pieces = list(pair.stream(PROMPT, max_new_tokens=10))
    final = pieces[-1]
    assert "".join(pieces[:-1]) == final.text == pair.generate(PROMPT, max_new_tokens=10).text
    assert len(pieces) > 2


def test_batch_of_prompts_equals_each_alone(pair):
    prompts = [PROMPT, "The quick brown fox", "In 1969 the first humans"]
    together = pair.generate(prompts, max_new_tokens=8)
    alone = [pair.generate(p, max_new_tokens=8) for p in prompts]
    assert [r.text for r in together] == [r.text for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert together[0].stats.batch_size == 3


def test_prompts_joining_a_running_batch_decode_as_alone(pair):
    prompts = ["The quick brown fox", PROMPT * 3, "In 1969 the first humans", "Paris is", PROMPT, "Once upon a time"]
    alone = [pair.generate(p, max_new_tokens=6 + 3 * (i % 3)) for i, p in enumerate(prompts)]
    rolling = [
        pair.generate(prompts, max_new_tokens=6 + 3 * i, max_batch_size=2)[i::3] for i in range(3)
    ]  # three calls, so each prompt gets its own length budget and rows finish at different rounds
    texts = {i + 3 * j: r.text for i, results in enumerate(rolling) for j, r in enumerate(results)}
    assert [texts[i] for i in range(len(prompts))] == [r.text for r in alone]
    with pytest.raises(ValueError, match="max_batch_size"):
        pair.generate(prompts, max_batch_size=0)


def test_the_last_waiting_prompts_join_as_soon_as_they_fit(pair, monkeypatch):
    running_at_join = []
    join = Scheduler.join

    def spy(self, new):
        running_at_join.append(len(self.batches[0].rows) if self.batches else 0)
        join(self, new)

    monkeypatch.setattr(Scheduler, "join", spy)
    prompts = ["The quick brown fox", "Paris is", "In 1969 the first humans", "Once upon a time", PROMPT]
    together = pair.generate(prompts, max_new_tokens=8, max_batch_size=4)
    assert running_at_join == [0, 3]  # one free slot of four is enough for the one prompt left waiting
    assert [r.text for r in together] == [pair.generate(p, max_new_tokens=8).text for p in prompts]


def test_generation_is_deterministic_and_counts_work(pair):
    a, b = pair.generate(PROMPT), pair.generate(PROMPT)
    assert a.text == b.text
    stats = a.stats
    assert stats.rounds == len(stats.words_per_round) and stats.new_tokens <= 12
    assert all(v >= stats.rounds for v in stats.forward_passes.values())
    assert stats.tokens_processed["tiny-llama"] >= len(pair.backends[0].encode_prompt(PROMPT))


def test_chat_messages_use_each_models_template(pair, llama_backend):
    llama_backend.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        messages = [{"role": "user", "content": "who wrote Hamlet?"}]
        assert llama_backend.render(messages).endswith("<|im_start|>assistant\n")
        assert pair.backends[1].render(messages).endswith("<start_of_turn>model\n")  # Gemma family fallback
        assert isinstance(pair.generate(messages, max_new_tokens=4).text, str)
    finally:
        llama_backend.tokenizer.chat_template = None
    assert llama_backend.render(messages) == "User: who wrote Hamlet?\nAssistant:"


def test_token_level_baseline_picks_highest_mean_probability(pair):
    result = pair.generate(PROMPT, unit="token", token_top_k=5, max_new_tokens=4, trace=True, scoring="mean")
    assert result.text and result.stats.rounds >= 1
    first = result.trace[0]
    assert 1 < len(first.candidates) <= 10
    for candidate in first.candidates:
        probs = []
        for backend in pair.backends:
            logprobs = full_logprobs(backend, backend.encode_prompt(PROMPT))
            tokens = backend.encode_piece(candidate.text)
            probs.append(float(backend.end_logprob(logprobs).exp() if candidate.ends else logprobs[tokens[0]].exp()))
        assert candidate.score == pytest.approx(-torch.log(torch.tensor(sum(probs) / 2)).item(), abs=1e-4)
    assert first.chosen == min(first.candidates, key=lambda c: c.score).text


def test_score_gives_each_models_mean_nll_of_whole_answers(pair):
    answers = [" Paris", " the capital of France"]
    scores = pair.score(PROMPT, answers)
    assert len(scores) == 2 and all(len(row) == 2 for row in scores)
    for row, answer in zip(scores, answers):
        for value, backend in zip(row, pair.backends):
            prompt, tokens = backend.encode_prompt(PROMPT), backend.encode_piece(answer)
            expected = -sum(float(full_logprobs(backend, prompt + tokens[:i])[t]) for i, t in enumerate(tokens)) / len(tokens)
            assert value == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="non-empty"):
        pair.score(PROMPT, [""])


def test_a_span_may_not_end_before_min_tokens(llama_backend):
    """With the end token likeliest, the span starts with the next likeliest token instead, and may end after it."""
    vocab = llama_backend.tokenizer.get_vocab()
    logprobs = _one_hot_logprobs(llama_backend, llama_backend.end_ids[0])
    logprobs[vocab["Ġwho"]] = -1.0
    config = FusionConfig(tau_delta=1.0, num_branches=1)
    with pytest.raises(StopIteration) as free:
        next(propose_row(llama_backend, logprobs, None, config, 50))
    assert free.value.value.proposals[0].tokens == [] and free.value.value.proposals[0].ends
    held = propose_row(llama_backend, logprobs, None, config, 50, min_tokens=1)
    assert next(held) == [(vocab["Ġwho"], -1)]
    with pytest.raises(StopIteration) as done:
        held.send(([0], _one_hot_logprobs(llama_backend, llama_backend.end_ids[0])[None], None))
    assert done.value.value.proposals[0].tokens == [vocab["Ġwho"]] and done.value.value.proposals[0].ends


def test_min_new_tokens_refuses_a_distribution_of_only_end_tokens(llama_backend):
    """A served model's top-k may hold only end tokens: masking them would leave nothing, so the error says so
    instead of renormalising to NaN."""
    logprobs = torch.full((2, llama_backend.vocab_size), -torch.inf)
    logprobs[:, llama_backend.end_ids[0]] = 0.0
    logprobs[0, 5] = -1.0
    with pytest.raises(RuntimeError, match="only end tokens.*min_new_tokens"):
        llama_backend.without_end(logprobs)
    assert llama_backend.without_end(logprobs[:1])[0, 5] == 0.0


@pytest.mark.parametrize("unit", ["word", "token"])
def test_min_new_tokens_keeps_an_answer_from_ending_empty(llama_backend, monkeypatch, unit):
    """Make the model's likeliest first token its end token: the answer is empty, unless min_new_tokens holds the end
    back until the answer has that many tokens."""
    first = int(llama_backend.start([llama_backend.encode_prompt(PROMPT)]).root_logprobs[0].argmax())
    monkeypatch.setattr(llama_backend, "end_ids", [first])
    single = AdaFuse([llama_backend], FusionConfig(tau_delta=0.0, num_branches=1, unit=unit, max_new_tokens=8))
    empty = single.generate(PROMPT)
    assert (empty.text, empty.finish_reason) == ("", "eos")
    held = single.generate(PROMPT, min_new_tokens=3)
    assert held.text.strip() and len(llama_backend.encode_piece(held.text)) >= 3


def test_adaptive_sampling_respects_min_new_tokens(llama_backend, monkeypatch):
    first = int(llama_backend.start([llama_backend.encode_prompt(PROMPT)]).root_logprobs[0].argmax())
    monkeypatch.setattr(llama_backend, "end_ids", [first])
    sampler = AdaptiveSampler(llama_backend)
    assert sampler.sample([PROMPT], max_new_tokens=8)[0].new_tokens == 0
    assert sampler.sample([PROMPT], max_new_tokens=8, min_new_tokens=3)[0].new_tokens >= 3
