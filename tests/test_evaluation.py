"""The evaluation harness on the tiny pair over three rows of each benchmark."""
import json

import pytest

from adafuse.benchmarks import BENCHMARKS, benchmark_root, final_number
from adafuse.evaluation import Evaluator, expand_methods


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
        rows = (benchmark_root() / name / "dev.jsonl").read_text().splitlines()[:4]
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
    assert (out / "accuracy_vs_forward_passes.png").stat().st_size > 0
    assert (out / "words_per_round.png").stat().st_size > 0


def test_unknown_benchmark_is_named(pair, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        Evaluator(pair, tiny_data, tmp_path).run(["mmlu"], ["adafuse"], limit=1)
