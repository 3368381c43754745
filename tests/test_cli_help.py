"""`fmoe plan --help` and `fmoe simulate --help` say what the command does and show examples, as `fmoe
train --help` does; every example shown parses with the command's own options (issue 34)."""

from __future__ import annotations

import shlex

import pytest

from fmoe.cli.main import main


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _examples(text: str, command: str) -> list[str]:
    """The one-line examples under "Examples:" (comments cut), as typed."""
    body = text.split("Examples:", 1)[1].split("\noptions:", 1)[0]
    return [ln.split("  #", 1)[0].strip() for ln in body.splitlines()
            if ln.strip().startswith(f"fmoe {command} ") and not ln.rstrip().endswith("\\")]


SAYS = {"plan": "rank every", "simulate": "Simulate a pipeline schedule", "train": "Train an MoE GPT"}


@pytest.mark.parametrize("command", list(SAYS))
def test_help_describes_the_command_and_its_examples_parse(capsys: pytest.CaptureFixture[str], command: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    says = SAYS[command]
    text = _help(capsys, command)
    assert says in text.split("options:", 1)[0], text[:400]
    examples = _examples(text, command)
    assert len(examples) >= 3, text[:1200]
    from fmoe.cli import main as cli

    ran = []
    monkeypatch.setattr(cli.COMMANDS[command], "run", lambda args: ran.append(args) or 0)
    for line in examples:
        assert main(shlex.split(line)[1:]) == 0, line  # parsed (not run)
    assert len(ran) == len(examples)
