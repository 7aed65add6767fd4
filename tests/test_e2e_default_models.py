"""End to end on the embedded default pair (SmolLM2-135M-Instruct + Gemma-3-270M), CPU."""
import json
from pathlib import Path

import pytest

from adafuse import AdaFuse
from adafuse.cli import main

pytestmark = pytest.mark.e2e
NQ = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks" / "nq"


@pytest.fixture(scope="module")
def default_pair() -> AdaFuse:
    return AdaFuse.from_pretrained(max_new_tokens=24, stop=["\n"])


def _questions(count: int) -> list[dict]:
    with open(NQ / "dev.jsonl") as handle:
        return [json.loads(line) for line, _ in zip(handle, range(count))]


def test_few_shot_nq_answers_with_both_models_in_the_trace(default_pair):
    few_shot = (NQ / "prompt.txt").read_text()
    proposers = set()
    for row in _questions(3):
        result = default_pair.generate(f"{few_shot}\n\nQuestion: {row['question']}\nAnswer:", trace=True)
        assert result.text.strip(), row["question"]
        assert "\n" not in result.text and result.finish_reason in ("stop", "eos", "length")
        assert result.stats.rounds == len(result.trace)
        assert all(v >= result.stats.rounds for v in result.stats.forward_passes.values())
        for round_ in result.trace:
            assert set(round_.margins) == {"smollm2-135m", "gemma3-270m"}
            for candidate in round_.candidates:
                proposers.update(candidate.proposers)
                assert set(candidate.nll) == {"smollm2-135m", "gemma3-270m"}
    assert proposers == {"smollm2-135m", "gemma3-270m"}


def test_reading_comprehension_finds_the_answer_in_context(default_pair):
    prompt = ("Context: The Zephyr Tower was completed in 1931 in the city of Marlow.\n"
              "Question: In which city is the Zephyr Tower?\nAnswer:")
    assert "Marlow" in default_pair.generate(prompt).text


def test_cli_generate_prints_answer_and_stats(capsys):
    code = main(["generate", "The capital of France is", "--max-new-tokens", "6", "--trace"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "round 1" in out and "fused=" in out
    assert "forward_passes" in err and "smollm2-135m" in err


def test_shipped_adapters_load_and_decode_on_their_base_model():
    from adafuse import ModelBackend
    from adafuse.sampling.policies import SHIPPED, SequenceAdapter, TokenAdapter
    from adafuse.sampling.adaptive import AdaptiveSampler, prompt_embeddings

    token = TokenAdapter.load(SHIPPED / "smollm2-135m-token-arithmetic")
    sequence = SequenceAdapter.load(SHIPPED / "smollm2-135m-sequence-arithmetic")
    assert token.base_model == sequence.base_model == "smollm2-135m"
    backend = ModelBackend.from_pretrained(token.base_model)
    prompt = "Question: What is 3 + 4?\nAnswer: 7\n\nQuestion: What is 2 + 5?\nAnswer:"
    rollout = AdaptiveSampler(backend, token).sample([prompt], max_new_tokens=4, stop=("\n",))[0]
    assert rollout.text.strip() and len(rollout.actions) >= 1
    assert sequence.choose(prompt_embeddings(backend, [prompt])[0], 4) in sequence.choices
