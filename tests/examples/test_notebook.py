"""examples/quickstart.ipynb runs headless, top to bottom, without a cell error.

Executed with nbclient on this interpreter's ipykernel (`pip install -e '.[test]'` brings nbclient,
nbformat and ipykernel). The notebook builds its own tiny model, starts and stops its own
`tokenmill serve` on a free 127.0.0.1 port, so it needs nothing from the other tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300

try:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
except ImportError as exc:  # pragma: no cover - CI installs the test extra
    pytest.fail(f"nbclient/nbformat/ipykernel missing ({exc}): pip install -e '.[test]'", pytrace=False)


def _outputs(nb, output_type: str) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == output_type]


def test_notebook_is_valid_and_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), (
        "commit the notebook without outputs"
    )


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path: Path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_before = os.environ.pop("TOKENMILL_QUICKSTART_MODEL", None)  # the notebook builds its own tiny model
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"notebook cell failed:\n{err}", pytrace=False)
    finally:
        if env_before is not None:
            os.environ["TOKENMILL_QUICKSTART_MODEL"] = env_before
    assert not _outputs(nb, "error")
    text = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
    assert "server ready at http://127.0.0.1:" in text
    assert "chunks streamed" in text
    for c in (1, 2, 4):
        assert f"concurrency {c}:" in text and "tokens/s" in text
    assert "server exit code: 0" in text
    images = [o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert images, "the benchmark plot was not rendered"
