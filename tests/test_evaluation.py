"""The evaluation harness on the tiny pair over three rows of each benchmark."""
import json
from pathlib import Path

import pytest

from adafuse.eval.benchmarks import BENCHMARKS, benchmark_root, corpus_translation_scores, final_number
from adafuse.eval.comparison import compare_with_members
from adafuse.eval.harness import Evaluator
from adafuse.eval.methods import engine_overrides, ensemble_of, expand_methods

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks"


def test_final_number_reads_boxed_then_answer_is_then_last_number():
    assert final_number("so \\boxed{1,234} in total") == 1234
    assert final_number("Therefore, the answer is 12.") == 12
    assert final_number("we get 5 apples and 6.5 pears") == 6.5
    assert final_number("no digits") is None


def test_benchmark_prompts_follow_the_shared_readme():
    nq, gsm8k = BENCHMARKS["nq"], BENCHMARKS["gsm8k"]
    assert nq.prompt("FEW", "q?") == "FEW\n\nQuestion: q?\nAnswer:"
    assert gsm8k.prompt("FEW", "q?") == "FEW\n\nQuestion: q?\nLet's think step by step\n"
    assert nq.extract(" Paris\n\nQuestion: next") == "Paris"
    assert gsm8k.score_row("... The answer is \\boxed{12}", "so the answer is 12") == {"accuracy": 1.0}


def test_method_names_expand_and_unknown_ones_fail():
    names = ["a", "b"]
    assert expand_methods("single,adafuse", names) == ["single:a", "single:b", "adafuse"]
    assert "fixed:2" in expand_methods("ablations", names) and "rerank" in expand_methods("baselines", names)
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        expand_methods("magic", names)
    with pytest.raises(ValueError, match="unknown method"):
        expand_methods("single:c", names)


@pytest.fixture()
def tiny_data(tmp_path):
    """Four rows of each benchmark with a one-line prompt and short questions, sized for tiny models."""
    root = tmp_path / "data"
    for name in BENCHMARKS:
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "prompt.txt").write_text("Answer briefly.")
        rows = (benchmark_root(DATA) / name / "dev.jsonl").read_text().splitlines()[:4]
        shortened = [json.dumps({**json.loads(r), "question": json.loads(r)["question"][-120:]}) for r in rows]
        (folder / "dev.jsonl").write_text("\n".join(shortened) + "\n")
    return root


def test_harness_writes_a_well_formed_report_and_resumes(pair, tiny_data, tmp_path):
    out = tmp_path / "out"
    evaluator = Evaluator(pair, tiny_data, out, max_new_tokens=6)
    methods = expand_methods("single,adafuse,unite,rerank,fixed:2", pair.model_names)
    evaluator.run(list(BENCHMARKS), methods, limit=3)
    lines = (out / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 3 * len(BENCHMARKS) * len(methods)
    record = json.loads(lines[0])
    assert {"prediction", "reference", "metrics", "wall_time_s", "forward_passes", "rounds"} <= set(record)
    evaluator.run(list(BENCHMARKS), methods, limit=3)  # resuming: nothing left to do
    assert len((out / "predictions.jsonl").read_text().splitlines()) == len(lines)
    evaluator.run(["nq"], methods, limit=4)  # a larger limit runs only the new rows
    assert len((out / "predictions.jsonl").read_text().splitlines()) == len(lines) + len(methods)
    report = evaluator.report("adafuse eval --test").read_text()
    for name in BENCHMARKS:
        assert f"## {name}" in report
    assert "| adafuse | 4 |" in report and "| adafuse | 3 |" in report and "chrf++" in report
    assert "adafuse eval --test" in report
    assert "## squad: fused against its best member" in report and "| rerank | 3 |" in report
    assert (out / "accuracy_vs_forward_passes.png").stat().st_size > 0
    assert (out / "words_per_round.png").stat().st_size > 0


def test_unknown_benchmark_is_named(pair, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        Evaluator(pair, tiny_data, tmp_path).run(["mmlu"], ["adafuse"], limit=1)


def test_ensemble_suffix_and_joined_options_parse():
    names = ["a", "b", "c"]
    assert ensemble_of("adafuse:scoring=mean;norm=token@a+c", names) == ["a", "c"]
    assert ensemble_of("rerank", names) == names and ensemble_of("single:b", names) == ["b"]
    assert engine_overrides("adafuse:scoring=mean;norm=token;sharpness=3@a+b", names) == {
        "scoring": "mean", "span_normalization": "token", "competence_sharpness": 3.0}
    assert engine_overrides("rerank@a+b", names) == {"rerank": "members"}
    assert engine_overrides("adafuse:rerank=all@a+b", names) == {"rerank": "all"}
    assert engine_overrides("rerank:scoring=mean@a+b", names) == {"rerank": "members", "scoring": "mean"}
    for bad in ["adafuse@a+d", "adafuse@a", "adafuse:sharpness=x", "adafuse:scoring=mean;bogus=1", "adafuse:tau=0.5;",
                "rerank:tau=0.5", "rerank:scoring=mean;"]:
        with pytest.raises(ValueError):
            expand_methods(bad, names)


def _records(values: dict[int, float]) -> dict[int, dict]:
    return {i: {"index": i, "metrics": {"accuracy": v, "exact_match": v}} for i, v in values.items()}


def test_comparison_with_members_counts_wins_losses_and_oracle():
    squad = BENCHMARKS["squad"]
    strong = _records({0: 1, 1: 1, 2: 0, 3: 0})
    weak = _records({0: 0, 1: 0, 2: 1, 3: 0})
    fused = _records({0: 1, 1: 0, 2: 1, 3: 1, 9: 1})  # row 9 was not run alone: left out
    c = compare_with_members(squad, fused, {"strong": strong, "weak": weak}, resamples=200)
    assert c["rows"] == 4 and c["best_member"] == "strong"
    assert (c["wins"], c["losses"]) == (2, 1)
    assert c["difference"] == pytest.approx(0.25) and c["oracle"] == pytest.approx(0.75)
    assert c["interval"][0] <= c["difference"] <= c["interval"][1]


def test_comparison_scores_translation_at_corpus_level():
    flores = BENCHMARKS["flores_de_en"]
    row = lambda text: {"prediction": text, "reference": "the cat sat on the mat"}
    member = {0: row("the cat sat on the mat"), 1: row("a dog")}
    fused = {0: row("the cat sat on the mat"), 1: row("the cat")}
    c = compare_with_members(flores, fused, {"a": member, "b": {0: row("x"), 1: row("the cat sat")}}, resamples=50)
    assert c["fused_score"] == pytest.approx(corpus_translation_scores([r["prediction"] for r in fused.values()],
                                                                       [r["reference"] for r in fused.values()])["chrf++"])
    assert c["oracle"] >= c["best_member_score"] and c["wins"] == 1 and c["losses"] == 0
