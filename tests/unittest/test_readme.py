from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme if line.startswith("bash scripts/setup.sh && ")]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci
