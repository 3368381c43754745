"""The structure figures of docs/structure.md: functions of the library (fmoe/, schedule/, transforms/) with
10 or more parameters, and those that take a `tp` parameter.

    python benchmarks/structure_counts.py [--root DIR]      # DIR: a checkout (default: this one)
"""

from __future__ import annotations

import argparse
import ast
import pathlib

FOLDERS = ("fmoe", "schedule", "transforms")


def functions(root: pathlib.Path) -> list[tuple[str, int, list[str]]]:
    """Returns (file:line, name, parameter names without self / cls) of every function under FOLDERS."""
    out = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                             if x.arg not in ("self", "cls")]
                    out.append((f"{path.relative_to(root)}:{node.lineno} {node.name}", len(names), names))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[1])
    root = ap.parse_args().root
    fns = functions(root)
    many = sorted((f for f in fns if f[1] >= 10), key=lambda f: -f[1])
    print(f"functions with 10 or more parameters: {len(many)}")
    for where, n, _ in many:
        print(f"  {n:3d}  {where}")
    tp = [where for where, _, names in fns if "tp" in names]
    print(f"functions taking tp: {len(tp)}")
    for where in tp:
        print(f"       {where}")


if __name__ == "__main__":
    main()
