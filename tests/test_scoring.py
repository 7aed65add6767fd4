"""Competence scoring: the demonstrations it reads, its weights against a direct computation, and its effect."""
import math

import pytest
import torch

from adafuse import AdaFuse, FusionConfig
from adafuse.backend import ModelBackend
from adafuse.fusion.scoring import (chosen_candidate, competence_weights, confident_weights, demonstration_spans,
                                    instructions_end, nats_per_char, scored_tokens)
from conftest import _llama

FEW_SHOT = "Question: one\nAnswer:{}\n\nQuestion: two\nAnswer:"


def test_demonstrations_follow_earlier_occurrences_of_the_final_cue():
    text = "Question: a\nAnswer: x y\n\nQuestion: b\nAnswer: z\n\nQuestion: c\nAnswer:"
    assert [text[a:b] for a, b in demonstration_spans(text)] == [" x y", " z"]
    assert demonstration_spans("Translate this sentence:\nDer Hund bellt.\n") == []
    assert demonstration_spans("x\nA: not at a line start A: y\nA:") == [(len("x\nA:"), len("x\nA: not at a line start A: y\n"))]


def test_scored_tokens_and_nats_per_char_by_hand():
    text = "Q: a\nA: bc\n\nQ: d\nA:"
    offsets = [(0, 0), (0, 4), (4, 7), (7, 10), (10, 12), (12, 19)]  # a BOS, then tokens starting at 0, 4, 7, 10, 12
    scored = scored_tokens(text, offsets)
    assert scored == [False, False, False, True, False, False]  # only the token starting inside " bc"
    nll = [math.nan, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert nats_per_char(nll, scored, offsets) == pytest.approx(3.0 / 3)
    zero_shot = "Translate:\nHallo Welt\n"  # no demonstrations: the instructions (every line but the input) count
    assert scored_tokens(zero_shot, [(0, 0), (0, 9), (9, 11), (11, 16), (16, 22)]) == [False, True, True, False, False]
    assert scored_tokens("a single line\n", [(0, 0), (0, 2), (2, 5)]) == [False, False, False]
    assert nats_per_char([math.nan, 2.0, 4.0], [False, True, True], [(0, 0), (0, 2), (2, 5)]) == pytest.approx(6.0 / 5)
    assert scored_tokens(text, None) == [] and math.isnan(nats_per_char(nll, [], None))


def test_a_zero_shot_prompts_instructions_end_where_its_input_begins():
    assert instructions_end("Translate:\nHallo Welt\n") == len("Translate:\n")  # the input is the last line
    assert instructions_end("Be brief.\nQuestion: Who?\nAnswer:") == len("Be brief.\n")  # a cue takes the line before
    assert instructions_end("Question: What is the capital of France?\nAnswer:") == 0  # only the input: nothing to score
    assert instructions_end("Hallo Welt\n") == 0


def test_a_prompt_that_is_only_its_input_keeps_the_prior_weights(pair):
    prompt = "Question: What is the capital of France?\nAnswer:"
    weights = pair.generate(prompt, max_new_tokens=2, competence_sharpness=30.0).stats.model_weights
    assert list(weights.values()) == pytest.approx([0.5, 0.5])
    instructed = pair.generate("Be brief and exact.\n" + prompt, max_new_tokens=2, competence_sharpness=30.0)
    assert list(instructed.stats.model_weights.values()) != pytest.approx([0.5, 0.5])  # scored where there is text


def test_competence_weights_formula():
    prior = torch.tensor([0.5, 0.5])
    weights = competence_weights(prior, [0.3, 0.5], sharpness=10.0)
    assert weights[1] / weights[0] == pytest.approx(math.exp(-2.0))
    assert weights.sum() == pytest.approx(1.0)
    assert torch.equal(competence_weights(prior, [math.nan, 0.5], 10.0), prior)
    assert torch.allclose(competence_weights(prior, [0.3, 0.5], 0.0), prior)


def _direct_nats(backend, text: str) -> float:
    """A model's NLL per character of the prompt's demonstrations, from one uncached forward over the prompt."""
    ids = backend.encode_prompt(text)
    with torch.no_grad():
        logits = backend.model(torch.tensor([ids])).logits[0, :-1].float()
    nll = [math.nan] + (torch.logsumexp(logits, -1) - logits.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()
    offsets = backend.prompt_offsets(text)
    return nats_per_char(nll, scored_tokens(text, offsets), offsets)


def test_competence_weights_and_fused_scores_match_a_direct_computation(pair):
    prompt = FEW_SHOT.format("Paris is big")
    result = pair.generate(prompt, trace=True, max_new_tokens=4, tau_delta=1.0, competence_sharpness=3.0)
    nats = [_direct_nats(backend, prompt) for backend in pair.backends]
    expected = competence_weights(torch.tensor([0.5, 0.5]), nats, 3.0)
    weights = result.stats.model_weights
    assert [weights[name] for name in pair.model_names] == pytest.approx(expected.tolist(), abs=1e-4)
    for candidate in result.trace[0].candidates:
        assert candidate.score == pytest.approx(sum(weights[m] * candidate.nll[m] for m in weights), abs=1e-4)


def test_prefix_reuse_keeps_the_demonstrations_scores(pair):
    first = FEW_SHOT.format(" Paris is big").replace("two", "two x")
    second = FEW_SHOT.format(" Paris is big").replace("two", "two y")
    cold = AdaFuse(pair.backends, FusionConfig(max_new_tokens=2, tau_delta=1.0))
    for backend in pair.backends:
        backend.prefix_cache.entries.clear()
    alone = cold.generate(second).stats.model_weights
    cold.generate(first)
    reused = cold.generate(second).stats.model_weights
    assert reused == pytest.approx(alone, abs=1e-5)


def _trained_on(text: str, tokenizer, steps: int = 40) -> torch.nn.Module:
    """A tiny llama fitted to `text`, so it explains that text far better than its untrained twin."""
    model = _llama(tokenizer, seed=1).train()
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return model.eval()


def test_weights_move_toward_the_model_that_explains_the_demonstrations(byte_level_tokenizer):
    taught = "Question: one\nAnswer: the cat sat on the mat\n\n"
    fitted = ModelBackend(_trained_on(taught, byte_level_tokenizer), byte_level_tokenizer, name="fitted")
    untrained = ModelBackend(_llama(byte_level_tokenizer, seed=1), byte_level_tokenizer, name="untrained")
    pair = AdaFuse([untrained, fitted], FusionConfig(max_new_tokens=2, tau_delta=1.0, competence_sharpness=1.0))
    on_taught = pair.generate(FEW_SHOT.format(" the cat sat on the mat")).stats.model_weights["fitted"]
    on_other = pair.generate(FEW_SHOT.format(" a dog ran in the park")).stats.model_weights["fitted"]
    assert on_taught > 0.5
    assert on_taught > on_other


def test_zero_sharpness_reproduces_the_equal_mean_exactly(pair):
    prompts = [FEW_SHOT.format("Paris is big"), "Question: what is the capital of France?\nAnswer:"]
    mean = pair.generate(prompts, trace=True, scoring="mean")
    flat = pair.generate(prompts, trace=True, scoring="competence", competence_sharpness=0.0)
    for a, b in zip(mean, flat):
        assert a.text == b.text
        assert [r.chosen for r in a.trace] == [r.chosen for r in b.trace]
        assert [c.score for r in a.trace for c in r.candidates] == pytest.approx(
            [c.score for r in b.trace for c in r.candidates], abs=1e-6)


def test_confident_weights_formula():
    weights = torch.tensor([0.8, 0.2])
    nll = [[2.0, 0.5], [3.0, 0.7], [2.5, 1.5]]  # per candidate: model 0's NLL, model 1's; favourites 2.0 and 0.5
    scaled = confident_weights(weights, nll, sharpness=1.0)
    assert scaled[0] / scaled[1] == pytest.approx(4.0 * math.exp(-1.5))
    assert scaled.sum() == pytest.approx(1.0)
    assert torch.equal(confident_weights(weights, nll, 0.0), weights)
    assert torch.equal(confident_weights(weights, nll[:1], 5.0), weights)  # a lone candidate: nothing to weigh


def test_confidence_scaled_scores_match_a_direct_computation(pair):
    prompts = [FEW_SHOT.format(" Paris is big"), "The cat"]
    results = pair.generate(prompts, trace=True, max_new_tokens=12, tau_delta=1.0, scoring="mean", confidence_sharpness=2.0)
    names, moved = pair.model_names, 0
    for result in results:
        for round_ in (r for r in result.trace if len(r.candidates) > 1):
            nll = [[c.nll[name] for name in names] for c in round_.candidates]
            weights = confident_weights(torch.tensor([0.5, 0.5], dtype=torch.float64), nll, 2.0)
            moved += abs(float(weights[0]) - 0.5) > 0.01
            assert [c.score for c in round_.candidates] == pytest.approx([sum(w * x for w, x in zip(weights.tolist(), row)) for row in nll], rel=1e-4)
    assert moved > 0


def test_the_most_weighted_model_vetoes_candidates_beyond_the_margin():
    nll = [[0.2, 3.0], [2.0, 0.1], [0.5, 1.0]]  # per candidate: model 0's NLL, model 1's
    fused = [1.6, 1.05, 0.75]
    assert chosen_candidate(nll, fused, torch.tensor([0.5, 0.5]), None) == 2
    assert chosen_candidate(nll, fused, torch.tensor([0.8, 0.2]), 0.2) == 0  # only 0.2 and 0.5 - 0.3 > 0.2 are out
    assert chosen_candidate(nll, fused, torch.tensor([0.8, 0.2]), 0.3) == 2
    assert chosen_candidate(nll, fused, torch.tensor([0.2, 0.8]), 0.0) == 1  # model 1 leads: its favourite only
    assert chosen_candidate(nll, fused, torch.tensor([0.5, 0.5]), 0.0) == 0  # a tie: the first model leads


def _overruled_rounds(results, lead: str) -> int:
    """Rounds whose chosen candidate has a higher NLL under `lead` than the lead's favourite candidate."""
    return sum(next(c for c in r.candidates if c.text == r.chosen).nll[lead] > min(c.nll[lead] for c in r.candidates) + 1e-6
               for result in results for r in result.trace)


def test_a_zero_veto_margin_leaves_the_leading_model_its_favourite_every_round(pair):
    prompts = [FEW_SHOT.format(" Paris is big"), "Question: what is the capital of France?\nAnswer:", "The cat"]
    options = dict(trace=True, max_new_tokens=16, tau_delta=1.0, scoring="mean")  # equal weights: the first model leads
    free = pair.generate(prompts, **options)
    assert _overruled_rounds(free, pair.model_names[0]) > 0
    assert _overruled_rounds(pair.generate(prompts, veto_margin=0.0, **options), pair.model_names[0]) == 0
    assert [r.text for r in pair.generate(prompts, veto_margin=1e9, **options)] == [r.text for r in free]


@pytest.mark.parametrize("bad", [{"veto_margin": -0.1}, {"veto_margin": math.nan}, {"scoring": "vote"}, {"competence_sharpness": -1.0}, {"competence_sharpness": math.nan},
                                 {"confidence_sharpness": -1.0}, {"confidence_sharpness": math.inf},
                                 {"model_weights": [1.0, math.nan]}, {"model_weights": [1.0, math.inf]},
                                 {"competence_sharpness": "x"}, {"model_weights": ["a", 1.0]}, {"span_normalization": "word"}])
def test_bad_scoring_parameters_are_named(pair, bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        pair.generate("hi", **bad)


def test_rank_weighs_whole_answers_as_fusion_weighs_the_models(pair):
    """`rank` is each model's mean NLL of an answer averaged with the weights generation gives the prompt."""
    prompt, answers = FEW_SHOT.format(" Paris is big"), [" Paris", " the capital of France"]
    weights = pair.generate(prompt, max_new_tokens=1).stats.model_weights
    assert abs(weights["tiny-llama"] - weights["tiny-gemma"]) > 0.05  # so an equal mean would not pass
    scores = pair.score(prompt, answers)
    expected = [sum(weights[name] * value for name, value in zip(pair.model_names, row)) for row in scores]
    assert pair.rank(prompt, answers) == pytest.approx(expected, abs=1e-5)
    assert pair.rank(prompt, answers, scoring="mean") == pytest.approx([sum(row) / 2 for row in scores], abs=1e-5)
    with pytest.raises(ValueError, match="non-empty"):
        pair.rank(prompt, [" Paris", ""])


def test_rerank_returns_the_pooled_answer_that_rank_prefers(pair):
    """rerank="members" picks among the models' own greedy answers, "all" adds the fused one; the pick is `rank`'s."""
    prompts = [FEW_SHOT.format(" Paris is big"), FEW_SHOT.format(" a cat")]
    fused = [r.text for r in pair.generate(prompts, max_new_tokens=6)]
    alone = [[r.text for r in AdaFuse([b]).generate(prompts, max_new_tokens=6, tau_delta=0.0, num_branches=1)]
             for b in pair.backends]
    for rerank, pools in [("members", [list(texts) for texts in zip(*alone)]),
                          ("all", [[f, *texts] for f, texts in zip(fused, zip(*alone))])]:
        results = pair.generate(prompts, max_new_tokens=6, rerank=rerank)
        for prompt, pool, result in zip(prompts, pools, results):
            answers = list(dict.fromkeys(text for text in pool if text.strip()))
            assert len(answers) >= 2  # so the choice is made by rank, not by default
            scores = pair.rank(prompt, answers)
            assert result.text == answers[scores.index(min(scores))]
            assert set(result.stats.model_weights) == set(pair.model_names)
            assert all(result.stats.row_forward_passes[name] > 0 for name in pair.model_names)
        traced = pair.generate(prompts, max_new_tokens=6, rerank=rerank, trace=True)
        assert [r.text for r in traced] == [r.text for r in results]
        assert all(r.trace and "".join(round_.chosen for round_ in r.trace).startswith(r.text) for r in traced)
    *pieces, final = list(pair.stream(prompts[0], max_new_tokens=6, rerank="all"))
    assert "".join(pieces) == final.text == pair.batcher.generate(prompts[0], max_new_tokens=6, rerank="all").text
    with pytest.raises(ValueError, match="rerank"):
        pair.generate(prompts[0], rerank="best")
