"""Packaging: the wheel installs only the `fmoe` top-level package (schedule/ and transforms/ ship as
fmoe.schedule and fmoe.transforms), holds every source module, and `import fmoe.schedule` loads no model."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as.
SOURCES = {"fmoe": "fmoe", "schedule": "fmoe/schedule", "transforms": "fmoe/transforms"}


def _build_wheel(out: Path) -> Path:
    # No build isolation: the venv's setuptools builds it offline, in seconds.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, timeout=240, capture_output=True)
    (wheel,) = out.glob("fmoe-*.whl")
    return wheel


def test_wheel_installs_only_fmoe_and_every_module(tmp_path: Path) -> None:
    names = zipfile.ZipFile(_build_wheel(tmp_path)).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"fmoe"}, top
    expected = {f"{dst}/{p.relative_to(ROOT / src).as_posix()}"
                for src, dst in SOURCES.items() for p in (ROOT / src).rglob("*.py")}
    missing = expected - set(names)
    assert not missing, f"modules left out of the wheel (add their package to pyproject.toml): {missing}"


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True,
                         text=True, cwd=ROOT).stdout
    return set(out.split())


MODEL_MODULES = {"fmoe.router", "fmoe.layer", "fmoe.block", "fmoe.model", "fmoe.experts", "fmoe.capacity"}


def test_import_schedule_loads_no_model() -> None:
    loaded = _modules_after("import fmoe.schedule")
    assert not loaded & MODEL_MODULES, loaded & MODEL_MODULES
    assert "fmoe.parallel" not in loaded and "fmoe.ops" not in loaded


def test_import_ops_loads_no_model_and_fmoe_no_hypothesis() -> None:
    assert not _modules_after("import fmoe.ops") & MODEL_MODULES
    loaded = _modules_after("import fmoe, fmoe.transforms")
    assert "hypothesis" not in loaded and not loaded & MODEL_MODULES


def _imported(path: Path) -> set[str]:
    """The modules a source file imports anywhere (at the top or inside a function)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_planner_imports_nothing_of_training_or_the_cli() -> None:
    # the planner (layouts, costs, search) sits under the trainer and the CLI: `fmoe.cli.plan` turns its
    # layouts into `fmoe train` command lines, not the planner
    for path in (ROOT / "fmoe" / "plan").rglob("*.py"):
        above = {m for m in _imported(path) if m.split(".")[:2] in (["fmoe", "train"], ["fmoe", "cli"])}
        assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


def test_lazy_names_resolve() -> None:
    import fmoe
    import fmoe.transforms

    assert callable(fmoe.moe) and callable(fmoe.transforms.check_vjp)
    assert "moe" in dir(fmoe)
    try:
        fmoe.not_a_name  # noqa: B018
    except AttributeError as exc:
        assert "not_a_name" in str(exc)
    else:
        raise AssertionError("unknown attribute did not raise")
