"""The zero3 pass on captured models: valid, every gathered parameter freed in the
function that gathered it, and (over one rank, where collectives run in one process)
training through the sharded program matches eager."""

from __future__ import annotations

import pytest
import torch

import dcir
from test_backend import CASES, train_side_by_side


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_program_is_valid_and_frees_every_gathered_parameter(case):
    make, inputs, loss_fn = CASES[case]
    torch.manual_seed(0)
    args, kwargs = inputs()
    module = dcir.compile_to_ir(make(), args, kwargs=kwargs, loss_fn=loss_fn)
    dcir.run_passes(module, "zero3{world_size=2}")
    dcir.verify(module, shapes=True)
    trainable = {d.name for d in module.decls.values() if d.trainable}
    for func in module.functions.values():
        gathered = {op.results[0] for op in func.ops
                    if op.name == "comm.wait" and op.operands[0].owner.name == "comm.all_gather"}
        freed = {v for op in func.ops if op.name == "mem.free" for v in op.operands}
        assert gathered <= freed, f"@{func.name} keeps gathered parameters: {[v.name for v in gathered - freed]}"
    reduced = [op for op in module.functions["backward"].ops if op.name == "comm.reduce_scatter"]
    assert len(reduced) == len(trainable)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_rank_zero3_trains_like_eager(case):
    train_side_by_side(case, passes="zero3{world_size=1}")
