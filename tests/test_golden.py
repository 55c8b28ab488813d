"""Golden tests, tier 1: every ``tests/golden/**/*.dcir`` runs its ``// RUN:`` lines.

RUN lines are shell commands (bash, ``set -o pipefail``): ``%s`` is the file itself,
``not CMD`` succeeds when CMD fails (as in LLVM's lit), and ``filecheck`` checks the
``// CHECK:`` lines. Every chunk of every golden file that parses also round-trips:
printing, parsing and printing again gives the same bytes; a chunk that fails to parse
or to verify must expect the errors it raises.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dcir
from dcir.cli import SPLIT_MARKER

GOLDEN = Path(__file__).parent / "golden"
FILES = sorted(GOLDEN.rglob("*.dcir"))
RUN = re.compile(r"^//\s*RUN:\s?(.*)$", re.M)


def run_lines(path: Path) -> list[str]:
    lines, joined = [], ""
    for m in RUN.finditer(path.read_text()):
        part = m.group(1).rstrip()
        if part.endswith("\\"):
            joined += part[:-1] + " "
            continue
        lines.append(joined + part)
        joined = ""
    return lines


def to_shell(line: str, path: Path) -> str:
    line = line.replace("%s", str(path))
    return re.sub(r"(^|\|\s*)not\s+([^|]*)", lambda m: f"{m.group(1)}(! {m.group(2).strip()}) ", line)


def _env() -> dict:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(GOLDEN)) for p in FILES])
def test_run_lines(path: Path):
    lines = run_lines(path)
    assert lines, f"{path} has no RUN line"
    assert shutil.which("filecheck", path=_env()["PATH"]), "filecheck is not installed (pip install -e .[test])"
    for line in lines:
        cmd = to_shell(line, path)
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                              cwd=path.parent, env=_env(), timeout=120)
        assert proc.returncode == 0, f"RUN: {line}\n$ {cmd}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _chunks(text: str) -> list[str]:
    return [c for c in SPLIT_MARKER.split(text)]


#: what a chunk says it is rejected with: ``// expected-error {{...}}``, or an ``error:``
#: its CHECK lines look for (a rendered diagnostic)
_EXPECTED_ERROR = re.compile(r"//\s*expected-error[^{\n]*\{\{(.*?)\}\}|//\s*[\w-]*CHECK[\w-]*:.*?\berror: (.*)$", re.M)


def expected_errors(chunk: str) -> list[str]:
    return [a or b for a, b in _EXPECTED_ERROR.findall(chunk)]


def _assert_expected(chunk: str, error: dcir.DcirError, stage: str, path: Path) -> None:
    """A chunk that fails to parse or to verify is a diagnostics test: every error it
    raises is one it expects."""
    name = str(path.relative_to(GOLDEN))
    assert "passes" not in path.parts, f"{name}: a {stage} error in a pass test: {error}"
    expected = expected_errors(chunk)
    assert expected, f"{name}: a {stage} error in a chunk that expects none:\n{error}\n{chunk}"
    for d in error.diagnostics:
        if d.severity == "error":
            assert any(e in d.message for e in expected), f"{name}: unexpected {stage} error: {d.message}"


def _assert_round_trips(chunk: str, module: dcir.Module) -> None:
    printed = dcir.print(module)
    again = dcir.parse(printed)
    assert again == module
    assert dcir.print(again) == printed
    assert dcir.parse(chunk, fast=False) == module, "the fast path and the full grammar disagree"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(GOLDEN)) for p in FILES])
def test_round_trip(path: Path):
    """Every chunk that parses round-trips (verified or not: printing does not need a valid
    module); every chunk that fails to parse or to verify fails with errors it expects."""
    valid, text = 0, path.read_text()
    shapes = any("--verify-shapes" in line for line in run_lines(path))  # verified as its RUN lines verify it
    for chunk in _chunks(text):
        try:
            module = dcir.parse(chunk, str(path))
        except dcir.DcirError as e:
            _assert_expected(chunk, e, "parse", path)
            with pytest.raises(dcir.DcirError):
                dcir.parse(chunk, fast=False)  # the full grammar rejects it too
            continue
        _assert_round_trips(chunk, module)
        try:
            dcir.verify(module, shapes=shapes)
        except dcir.DcirError as e:
            _assert_expected(chunk, e, "verify", path)
            continue
        assert "expected-error" not in chunk, f"{path.name}: a chunk that expects an error is valid:\n{chunk}"
        valid += 1
    if "verifier" not in path.parts and "diagnostics" not in path.parts:
        assert valid, f"{path} holds no valid module"
