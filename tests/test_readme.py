"""The README's first lines are the two set-up commands, and CI runs the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_two_commands():
    text = (ROOT / "README.md").read_text()
    assert text.index("```bash") < 20, "the set-up commands must be the README's first lines"
    assert len(_readme_commands()) == 2


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def test_readme_python_examples_run():
    import subprocess
    import sys
    text = (ROOT / "README.md").read_text()
    for block in text.split("```python\n")[1:]:
        code = block.split("```", 1)[0]
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, f"README example failed:\n{code}\n{proc.stderr}"
