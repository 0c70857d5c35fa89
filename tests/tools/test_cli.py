"""`ember …` help texts: every subcommand lists its own options and shows itself as `ember …`."""

from __future__ import annotations

import pytest

from ember.tools.cli import main


def _help(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_demo_help_lists_its_options(capsys):
    text = _help("demo", capsys=capsys)
    assert text.startswith("usage: ember demo"), text
    for option in ("--workloads", "--dtype", "--device", "softmax", "bfloat16"):
        assert option in text, f"{option} missing from:\n{text}"


@pytest.mark.parametrize("command", ["demo", "bench", "fuzz", "opinfo", "bisect"])
def test_help_shows_the_ember_command(command, capsys):
    """The usage line and the examples name `ember COMMAND`, not `python -m ember.tools.…`."""
    text = _help(command, capsys=capsys)
    assert text.startswith(f"usage: ember {command}"), text
    examples = [line.strip() for line in text.splitlines() if line.startswith("    ")]
    examples = [line for line in examples if line.startswith(("ember ", "python -m "))]
    assert examples and examples[0].startswith(f"ember {command}"), text
