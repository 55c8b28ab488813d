"""Golden tests, tier 1: every ``tests/golden/**/*.dcir`` runs its ``// RUN:`` lines.

RUN lines are shell commands (bash, ``set -o pipefail``): ``%s`` is the file itself,
``not CMD`` succeeds when CMD fails (as in LLVM's lit), and ``filecheck`` checks the
``// CHECK:`` lines. Every golden file that is a valid module also round-trips:
printing, parsing and printing again gives the same bytes.
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


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(GOLDEN)) for p in FILES])
def test_round_trip(path: Path):
    valid = 0
    for chunk in _chunks(path.read_text()):
        try:
            module = dcir.parse(chunk, str(path))
            dcir.verify(module)
        except dcir.DcirError:
            continue  # the negative cases of diagnostics tests
        printed = dcir.print(module)
        again = dcir.parse(printed)
        assert again == module
        assert dcir.print(again) == printed
        assert dcir.parse(chunk, fast=False) == module, "the fast path and the full grammar disagree"
        valid += 1
    if "verifier" not in path.parts and "diagnostics" not in path.parts:
        assert valid, f"{path} holds no valid module"
