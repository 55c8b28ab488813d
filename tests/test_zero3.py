"""The zero3 pass on captured models: valid, every gathered parameter freed in the
function that gathered it, and (over one rank, where collectives run in one process)
training through the sharded program matches eager."""

from __future__ import annotations

import copy

import pytest
import torch

import dcir
from dcir_lowering.backend import state_of
from test_backend import CASES, _close


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
    make, inputs, loss_fn = CASES[case]
    torch.manual_seed(0)
    ref = make()
    mine = copy.deepcopy(ref)
    args, kwargs = inputs()
    module = dcir.compile_to_ir(ref, args, kwargs=kwargs, loss_fn=loss_fn)
    dcir.run_passes(module, "zero3{world_size=1}")
    program = dcir.lower(module, state_of(mine))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    for _ in range(3):
        opt_ref.zero_grad()
        out = ref(*args, **kwargs)
        loss_ref = loss_fn(out) if loss_fn else out
        loss_ref.backward()
        opt_ref.step()
        opt_mine.zero_grad()
        loss_mine = program.train_step(*args, **kwargs)
        opt_mine.step()
        assert abs(loss_ref.item() - loss_mine.item()) <= 1e-6 * abs(loss_ref.item())
    for (name, a), (_, b) in zip(state_of(ref).items(), state_of(mine).items()):
        if a.dtype.is_floating_point:
            assert _close(a, b), name
        else:
            assert torch.equal(a, b), name
