"""The README's Quick start commands, as CI runs them: read from README.md so the two cannot drift.

    python3 .ci/readme_commands.py install 2    # the set-up part of command 2 (everything before the test runner)
    python3 .ci/readme_commands.py run 2        # the rest of command 2 (the test runner)
    python3 .ci/readme_commands.py whole 2      # command 2 exactly as written

A command is one line of the first ```bash block under "## Quick start" that is not a comment. Its
set-up part ends before the last ` && `: the two parts joined by ` && ` are the command as written.
"""

from __future__ import annotations

import pathlib
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def quick_start_commands(text: str) -> list[str]:
    section = text.split("## Quick start", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def split_command(command: str) -> tuple[str, str]:
    """(set-up, run): the command as written is ``set_up + " && " + run``."""
    set_up, sep, run = command.rpartition(" && ")
    if not sep:
        raise ValueError(f"README command has no set-up part before its last ' && ': {command!r}")
    return set_up, run


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("install", "run", "whole") or not argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    commands = quick_start_commands(README.read_text(encoding="utf-8"))
    n = int(argv[1])
    if not 1 <= n <= len(commands):
        print(f"README.md's Quick start has {len(commands)} commands, not {n}", file=sys.stderr)
        return 2
    command = commands[n - 1]
    set_up, run = split_command(command)
    print({"install": set_up, "run": run, "whole": command}[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
