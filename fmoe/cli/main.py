"""The `fmoe` command line: one sub-command per job, each in its own module under fmoe/cli/."""

from __future__ import annotations

import argparse
import re
import sys

from fmoe.cli import convert, demo, plan, preprocess, simulate, train

COMMANDS = {"demo": demo, "plan": plan, "simulate": simulate, "train": train, "convert": convert,
            "preprocess": preprocess}


# a negative number argparse reads as an option of its own ("-1e-3", "-.5e2"; it knows "-1" and "-0.5")
_NEGATIVE = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf|-nan")


def negatives_as_values(argv: list[str]) -> list[str]:
    """`argv` with "--flag -1e-3" joined into "--flag=-1e-3": argparse takes a token starting with "-" and
    not a plain negative number for an option, and failed with "expected one argument"."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.fullmatch(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]) and run the chosen sub-command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="fmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(negatives_as_values(sys.argv[1:] if argv is None else argv))
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
