"""Golden tests, tier 2: full-text snapshots of what DCIR prints.

Each case is a ``dcir-opt`` command over a shipped file; its whole output (stdout and
stderr, exit status) is compared with ``tests/snapshots/<case>.txt``. Run
``pytest --update-goldens`` to rewrite them and review the change as a diff.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from dcir.cli import main

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOTS = Path(__file__).parent / "snapshots"

CASES = {
    "mlp_dce_canonicalize": ["examples/mlp.dcir", "--passes", "dce,canonicalize", "--pass-statistics"],
    "mlp_zero3_print_ir_after_all": ["examples/mlp_zero3.dcir", "--passes", "dce,canonicalize", "--print-ir-after-all"],
    "mlp_zero3": ["examples/mlp_zero3.dcir"],
    "diagnostics_rendered": ["tests/golden/diagnostics/rendered.dcir", "--split-input-file"],
}


def run(argv: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    return f"$ dcir-opt {' '.join(argv)}\n# exit {code}\n# stdout\n{out.getvalue()}# stderr\n{err.getvalue()}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_snapshot(case: str, update_goldens: bool, monkeypatch):
    monkeypatch.chdir(ROOT)
    got = run(CASES[case])
    path = SNAPSHOTS / f"{case}.txt"
    if update_goldens or not path.exists():
        path.write_text(got)
        if not update_goldens:
            pytest.fail(f"{path} did not exist and was written; review it and run again")
        return
    assert got == path.read_text(), f"snapshot {path.name} changed; review and run pytest --update-goldens"
