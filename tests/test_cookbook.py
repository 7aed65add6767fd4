"""The cookbook notebooks execute top to bottom on the embedded default models; their own cells assert."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.e2e
COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook"


@pytest.mark.parametrize("name", ["rag_langchain.ipynb", "rag_llamaindex.ipynb"])
def test_notebook_runs_and_answers(name):
    notebook = nbformat.read(COOKBOOK / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": str(COOKBOOK)}}).execute()
    printed = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []) if o.get("name") == "stdout")
    assert "fused" in printed and "answers contain the expected string" in printed
