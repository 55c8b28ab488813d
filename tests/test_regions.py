"""Graph-break regions through the Engine (``dcir_runtime.regions``): a step Dynamo splits
into several graphs trains sharded, each region its own DCIR program, equal to eager."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

import dcir
from dcir import signature
from dcir_runtime import native
from dcir_runtime.launch import launch
from models import BreakingNet, squared

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "dist_worker.py")


@pytest.fixture(scope="module", autouse=True)
def built():
    native.load()


def _run(capfd, nproc: int, *args: str, timeout_s: float = 300) -> tuple[int, str]:
    code = launch([WORKER, *args], nproc, timeout_s=timeout_s, grace_s=5)
    out, err = capfd.readouterr()
    return code, out + err


def _train(model, steps: int, config: dict, x_of):
    """``steps`` AdamW steps of ``model`` through a world-of-one Engine, and of a copy eagerly;
    the losses of both and the engine."""
    ref = copy.deepcopy(model)
    engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), config=config)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(steps):
        x = x_of(step)
        loss = squared(engine(x))
        engine.backward(loss)
        engine.step()
        ref_loss = squared(ref(x))
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    full = engine.full_parameters()
    worst = max(((full[n] - p).abs().max() / p.abs().max()).item() for n, p in ref.named_parameters())
    return losses, ref_losses, worst, engine


def test_each_region_is_a_module_of_its_own():
    """A world of one, each kind of break: the step runs as regions equal to eager, each a
    module whose backward hands the gradient of its computed inputs back ({input_grad}).
    A print is no break to capture (docs/frontend.md): that step is one program."""
    for how in ("item", "call", "print"):
        torch.manual_seed(0)
        losses, ref_losses, worst, engine = _train(BreakingNet(how), 3, {}, lambda s: torch.randn(4, 8) * (s + 1))
        assert losses == ref_losses and worst == 0.0, (how, losses, ref_losses, worst)
        modules = engine.programs.modules()
        if how == "print":
            assert len(modules) == 1 and engine.programs.regions is None
            continue
        assert len(modules) >= 2, how
        later = [m for m in modules if signature.input_grads(m.role("backward"))]
        assert later, (how, [str(m) for m in modules])
        for m in modules:  # each one text dcir-opt takes: parsed, verified, printed the same
            assert str(dcir.parse(str(m))) == str(m)


@pytest.mark.parametrize("world", [2, 3])
def test_regions_train_sharded_equal_to_eager(world, tmp_path, capfd):
    """Each kind of break (a .item() branch that ranks may take differently, a call Dynamo cannot
    trace, a print of a value) with ZeRO-1, 2 and 3: 5 AdamW steps equal to one-device eager."""
    cases = [f"breaks_{how}_zero{stage}" for how in ("item", "call", "print") for stage in (1, 2, 3)]
    if world == 3:
        cases = ["breaks_item_zero3", "breaks_call_zero1", "breaks_print_zero2", "breaks_item_zero1_accumulate2"]
    out_file = tmp_path / "results.json"
    code, out = _run(capfd, world, "equivalence", str(out_file), *cases, timeout_s=600)
    assert code == 0, out
    results = json.loads(out_file.read_text())
    for case in cases:
        assert results[case]["max_rel_err"] <= 1e-6, (case, results[case]["worst_param"], results[case]["max_rel_err"])


def test_ranks_that_branch_apart_fail_together(capfd):
    """Rank 0 takes a branch that runs a layer of its own: every rank names what each runs, in
    about a second, far within the 20 s timeout."""
    code, out = _run(capfd, 2, "diverging-branch", timeout_s=120)
    assert code == 0, out
    said = re.findall(r"error: the ranks' steps diverged at a graph break: (rank 0 runs .*?); (rank 1 runs .*?)\. ",
                      out)
    assert len(said) == 2, out
    for rank0, rank1 in said:
        assert re.fullmatch(r"rank 0 runs region\d \(models\.py:\d+-\d+, after the break at line \d+\)", rank0), rank0
        assert rank1.startswith("rank 1 runs region"), rank1
    seconds = [float(s) for s in re.findall(r"rank \d answered in ([\d.]+) s", out)]
    assert len(seconds) == 2 and max(seconds) < 10, out
