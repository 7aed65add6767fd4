"""The package's structure: inference never imports training or evaluation, no import loops, hooks instead of
patches, and a caller's model left as it is."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from adafuse import ModelBackend
from adafuse.eval.benchmarks import benchmark_root
from adafuse.kernels.cpu import PackedLinear

CORE = Path(__file__).resolve().parents[1] / "core"


def _modules() -> dict[str, Path]:
    return {("adafuse." + ".".join(p.relative_to(CORE).with_suffix("").parts)).removesuffix(".__init__"): p
            for p in CORE.rglob("*.py")}


def _imported(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each `from ... import` of the package in one module (lazy imports included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("adafuse")):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            found.append((".".join(filter(None, [base, node.module or ""])), [a.name for a in node.names]))
    return found


def _imports() -> dict[str, set[str]]:
    """Module name -> the adafuse modules it imports (a name imported from a package may be a module of it)."""
    files = _modules()
    return {
        name: {t for target, names in _imported(name, path) for t in [target, *(f"{target}.{n}" for n in names)]
               if t in files and t != name}
        for name, path in files.items()
    }


def test_every_import_of_the_package_names_a_module_that_exists():
    files = _modules()
    missing = [(name, target) for name, path in files.items() for target, _ in _imported(name, path) if target not in files]
    assert not missing


def test_inference_never_imports_training_or_evaluation():
    for module, targets in _imports().items():
        if module.split(".")[1:2] in (["runtime"], ["fusion"], ["sampling"], ["kernels"]):
            assert not {t for t in targets if t.split(".")[1] in ("training", "eval")}, module


def test_no_import_loops():
    # a package's __init__ importing its own modules is how it exports them, not a loop
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in _imports().items()}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph[module]:
            assert state.get(target) != "open", " -> ".join([*path, target])
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_a_callers_model_is_left_as_it_is_unless_cpu_kernels_are_asked_for(byte_level_tokenizer):
    from conftest import _llama

    model = _llama(byte_level_tokenizer, seed=5)
    ModelBackend(model, byte_level_tokenizer, name="mine")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert model.config._attn_implementation != "adafuse_cpu_sdpa"
    ModelBackend(model, byte_level_tokenizer, name="mine", cpu_kernels=True)
    assert any(isinstance(m, PackedLinear) for m in model.modules())


def test_forward_timing_hook_sees_every_forward(llama_backend):
    seen = []
    llama_backend.runner.on_forward = seen.append
    try:
        llama_backend.reset_counters()
        batch = llama_backend.start([llama_backend.encode_prompt("The quick brown fox")])
        batch.ensure_paths([[llama_backend.encode_piece(" jumps")]])
        passes = llama_backend.reset_counters()["forward_passes"]
    finally:
        llama_backend.runner.on_forward = None
    assert [t.kind for t in seen] == ["prefill"] + ["step"] * (passes - 1)
    assert all(t.model_type == "llama" and t.rows == 1 and t.seconds >= 0 for t in seen)


def test_the_library_never_guesses_where_benchmark_data_is(monkeypatch, tmp_path):
    monkeypatch.delenv("ADAFUSE_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match="ADAFUSE_DATA"):
        benchmark_root()
    monkeypatch.setenv("ADAFUSE_DATA", str(tmp_path))
    assert benchmark_root() == tmp_path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        benchmark_root(tmp_path / "missing")
