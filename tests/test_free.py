"""Free placement by liveness (``dcir/passes/free.py``): the pass the sharding passes
place their frees through. Its cases one by one are in ``tests/golden/passes/free.dcir``;
here, on a captured Llama, it recovers every free ``zero3`` placed (no later, the peak
unchanged), and a program with every free placed by it trains as eager does."""

from __future__ import annotations

import pytest
import torch

import dcir
from dcir import ops as registry
from dcir.memory import peaks
from dcir.rewrite import Rewriter
from models import tiny_llama
from test_backend import CASES, train_side_by_side


def _frees(module) -> dict[tuple[str, str], int]:
    """(function, freed value) -> how many ops other than frees come before its free."""
    out = {}
    for func in module.functions.values():
        done = 0
        for op in func.ops:
            if registry.has_trait(op, registry.FREES):
                out.update({(func.name, v.name): done for v in op.operands})
            else:
                done += 1
    return out


def _strip_frees(module) -> None:
    for func in module.functions.values():
        rewriter = Rewriter(func)
        for op in [op for op in func.ops if registry.has_trait(op, registry.FREES)]:
            rewriter.erase(op)


def test_free_placement_recovers_what_zero3_frees():
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    module = dcir.compile_to_ir(tiny_llama(), (), kwargs={"input_ids": ids, "labels": ids.clone()},
                                loss_fn=lambda out: out.loss)
    dcir.run_passes(module, "zero3{world_size=2}")
    placed_by_zero3, peak = _frees(module), peaks(module)
    _strip_frees(module)
    dcir.run_passes(module, "free")
    placed = _frees(module)
    assert len(placed_by_zero3) > 20
    late = {k: (placed.get(k), at) for k, at in placed_by_zero3.items() if placed.get(k, at + 1) > at}
    assert not late, f"freed later than zero3 placed it, or not at all (placed, zero3's): {late}"
    assert len(placed) > len(placed_by_zero3)  # the temporaries the model released implicitly, now explicit
    assert peaks(module) == peak


@pytest.mark.parametrize("case", ["mlp", "hf_llama"])
def test_every_free_placed_by_liveness_trains_as_eager(case):
    assert case in CASES
    train_side_by_side(case, "free")
