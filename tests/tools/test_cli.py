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


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_help_shows_the_ember_command(command, capsys):
    text = _help(command, capsys=capsys)
    usage_and_examples = [line for line in text.splitlines() if line.strip().startswith(("usage:", "ember "))]
    assert usage_and_examples and not any("python -m" in line for line in text.splitlines()[:12]), text
