"""Golden tests, tier 2: full-text snapshots of what DCIR prints.

Each case is a ``dcir-opt`` command over a shipped file; its whole output (stdout and
stderr, exit status) is compared with ``tests/snapshots/<case>.txt``. Run
``pytest --update-goldens`` to rewrite them and review the change as a diff.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import dcir
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
    compare(SNAPSHOTS / f"{case}.txt", run(CASES[case]), update_goldens)


def _models():
    from models import ConvBN, mlp, squared, tiny_llama
    return {
        "mlp": lambda: dcir.compile_to_ir(mlp(), (torch.randn(4, 8),), loss_fn=squared, name="mlp"),
        "cnn_batchnorm": lambda: dcir.compile_to_ir(ConvBN(), (torch.randn(2, 3, 8, 8), torch.tensor([0, 1])),
                                                    name="cnn_batchnorm"),
        "llama_2_layers": lambda: dcir.compile_to_ir(tiny_llama(), (), kwargs={"input_ids": torch.zeros(2, 16, dtype=torch.long),
                                                                               "labels": torch.ones(2, 16, dtype=torch.long)},
                                                     loss_fn=lambda out: out.loss, name="llama_2_layers"),
    }


@pytest.mark.parametrize("model", ["mlp", "cnn_batchnorm", "llama_2_layers"])
def test_captured_ir_snapshot(model: str, update_goldens: bool):
    """The IR capture produces for each reference model; a change in capture (or in
    torch's decompositions) shows up here as a diff to review."""
    torch.manual_seed(0)
    text = dcir.print(_models()[model]())
    assert dcir.print(dcir.parse(text)) == text
    compare(SNAPSHOTS / f"captured_{model}.dcir", text, update_goldens)


def compare(path: Path, got: str, update_goldens: bool) -> None:
    if update_goldens or not path.exists():
        path.write_text(got)
        if not update_goldens:
            pytest.fail(f"{path} did not exist and was written; review it and run again")
        return
    assert got == path.read_text(), f"snapshot {path.name} changed; review and run pytest --update-goldens"
