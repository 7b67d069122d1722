"""Every `effattn` command the README shows parses: its command exists and each option it passes is one
that command takes, with a value of the right type. (What a command then does with a model is tested
where the command is; this guards the README against options renamed or removed.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

try:  # typer 0.2x carries its own click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import UsageError

README = Path(__file__).resolve().parent.parent / "README.md"
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def readme_commands() -> list[list[str]]:
    """The argument lists of the `effattn ...` lines in the README's bash blocks (environment assignments in
    front dropped, comments and continuation lines handled)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and ENV.match(words[0]):
                words = words[1:]
            if words[:1] == ["effattn"]:
                commands.append(words[1:])
    return commands


def parse(args: list[str]) -> None:
    """Parse `effattn ARGS` as the CLI would, without running the command: raises UsageError for an unknown
    command or option, or a value of the wrong type."""
    from effattn.cli import _register_conversion_commands, app

    _register_conversion_commands()
    command = typer.main.get_command(app)
    ctx = command.make_context("effattn", list(args))
    while hasattr(command, "resolve_command"):  # a group: on to its subcommand
        protected = ctx.__dict__.get("_protected_args", ctx.__dict__.get("protected_args", []))
        name, command, rest = command.resolve_command(ctx, [*protected, *ctx.args])
        ctx = command.make_context(name, rest, parent=ctx)


COMMANDS = readme_commands()


def test_the_readme_shows_commands_of_every_kind():
    names = {args[0] for args in COMMANDS if args}
    assert {"inspect", "convert", "vq-init", "eval", "bench", "finetune", "recipes", "sample"} <= names, names
    assert len(COMMANDS) > 50


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a)[:80] for a in COMMANDS])
def test_every_readme_command_parses(args):
    try:
        parse(args)
    except typer.Exit as exc:  # --help: printed and left, as the command would
        assert exc.exit_code == 0
    except UsageError as exc:
        pytest.fail(f"README: effattn {shlex.join(args)}: {exc.format_message()}")


def test_a_renamed_option_would_fail_the_check():
    with pytest.raises(UsageError, match="--kv-hedas"):
        parse(["convert", "llama", "--to", "gqa", "--kv-hedas", "1", "-o", "out/x"])
    with pytest.raises(UsageError):
        parse(["eval", "llama", "--context", "many"])
    with pytest.raises(UsageError):
        parse(["recipes", "vallidate", "heal-gqa"])
