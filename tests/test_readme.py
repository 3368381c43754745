"""The README's API tour runs as written (so the README cannot drift from the API)."""

from __future__ import annotations

import pathlib

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_api_tour_runs(capsys):
    text = README.read_text()
    start = text.index("```python", text.index("## API tour")) + len("```python")
    code = text[start:text.index("```", start)]
    namespace: dict = {}
    exec(compile(code, "README.md (API tour)", "exec"), namespace)
    assert "dparams" in namespace and "state" in namespace
    assert "makespan" in capsys.readouterr().out
