"""README's two set-up commands are the project's contract with a fresh machine; CI must run
the second one exactly (the issue behind this: a README test command that passed only inside
.ci/run, which installed system libraries the README did not)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("kvgate demo")
    assert commands[1].endswith("-m pytest")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def test_the_test_command_sets_up_the_machine_first():
    # System libraries and engines come before the venv, so a fresh machine needs nothing else.
    assert _readme_commands()[1].startswith("bash engines/setup.sh && ")
    assert (ROOT / "engines" / "setup.sh").is_file()
