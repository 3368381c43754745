"""The `fmoe` command line: one sub-command per job, each in its own module under fmoe/cli/."""

from __future__ import annotations

import argparse
import sys

from fmoe.cli import convert, demo, plan, preprocess, simulate, train

COMMANDS = {"demo": demo, "plan": plan, "simulate": simulate, "train": train, "convert": convert,
            "preprocess": preprocess}


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]) and run the chosen sub-command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="fmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
