"""launch/colab_demo.ipynb runs top to bottom (on CPU, tiny model), so it cannot rot."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the test extra (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra (nbformat, nbclient, ipykernel)")

NOTEBOOK = Path(__file__).resolve().parents[1] / "launch" / "colab_demo.ipynb"


@pytest.mark.slow
def test_colab_notebook_executes_and_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXREPLAY_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("JAXREPLAY_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # learning curve, ratio comparison
    final = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert [line.split(" {")[0] for line in final.splitlines()] == ["spi 1", "spi 2", "spi 4"]
    for spi in (1, 2, 4):
        assert (tmp_path / "runs" / f"spi{spi}" / "summary.json").exists()
