"""The cookbook notebooks execute top to bottom on the embedded default models; their own cells assert too."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.e2e
COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook"
PRINTED = {
    "agent_langchain.ipynb": ["call:", "every call was answered"],
    "agent_llamaindex.ipynb": ["call:", "every call was answered"],
    "rag_langchain.ipynb": ["fused:", "answers contain the expected string", "round 1:"],
    "rag_llamaindex.ipynb": ["fused:", "answers contain the expected string"],
    "serving.ipynb": ["serving adafuse(", "served answers check out"],
    "streaming_and_tuning.ipynb": ["'tau': 1.0", "saved tau_sweep.png"],
    "structured_extraction.ipynb": ["constrained: 3/3", "every constrained reply validates"],
}


@pytest.mark.parametrize("name", sorted(PRINTED))
def test_notebook_runs_and_answers(name):
    notebook = nbformat.read(COOKBOOK / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": str(COOKBOOK)}}).execute()
    printed = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []) if o.get("name") == "stdout")
    for expected in PRINTED[name]:
        assert expected in printed
