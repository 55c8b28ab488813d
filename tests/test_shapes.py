"""Shapes that change: a smaller last batch, ranks with different batch sizes, and
sequence lengths that vary, each trained at world 2 with the loss computed outside and
compared with single-device eager; then a forward-only evaluation (``engine.eval()``
under ``torch.no_grad()``) against the eager model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcir_runtime.launch import launch

WORKER = str(Path(__file__).resolve().parent / "shapes_worker.py")


@pytest.mark.parametrize("case,programs", [("last_batch", 2), ("uneven_ranks", 2), ("sequence_lengths", 3)])
def test_changing_shapes_train_like_eager(case, programs, tmp_path, capfd):
    out = tmp_path / "out.json"
    code = launch([WORKER, case, str(out)], 2, timeout_s=240, grace_s=5)
    assert code == 0, capfd.readouterr()
    r = json.loads(out.read_text())
    assert r["worst"] <= 1e-5, r
    assert r["eval"] <= 1e-5, r
    # rank 0's training programs (its shapes), and one forward-only program that saves nothing
    assert r["programs"] == programs + 1, r
    assert ["eval"] in r["roles"] and all("eval" not in roles or roles == ["eval"] for roles in r["roles"]), r
