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
from models import BreakingNet, InPlaceNet, squared

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


# world 3 (every shard split unevenly): one case of each kind in the default tier, every case in the slow tier
@pytest.mark.parametrize("world,every", [(2, True), (3, False), pytest.param(3, True, marks=pytest.mark.slow)])
def test_regions_train_sharded_equal_to_eager(world, every, tmp_path, capfd):
    """Each kind of break (a .item() branch that ranks may take differently, a call Dynamo cannot
    trace, a print of a value) with ZeRO-1, 2 and 3: 5 AdamW steps equal to one-device eager."""
    cases = [f"breaks_{how}_zero{stage}" for how in ("item", "call", "print") for stage in (1, 2, 3)]
    cases += ["breaks_item_zero3_optimize", "breaks_call_zero2_optimize", "breaks_call_zero1_optimize",
              "eager_layer_zero1", "eager_layer_zero3", "inplace_eager_zero2", "inplace_eager_zero3",
              "breaks_item_zero1_accumulate2", "breaks_item_full_accumulate2"]
    if not every:
        cases = ["breaks_item_zero3", "breaks_call_zero1", "breaks_print_zero2", "breaks_item_zero1_accumulate2",
                 "eager_layer_zero3"]
    out_file = tmp_path / "results.json"
    code, out = _run(capfd, world, "equivalence", str(out_file), *cases, timeout_s=600)
    assert code == 0, out
    results = json.loads(out_file.read_text())
    for case in cases:
        r = results[case]
        assert r["max_rel_err"] <= 1e-6, (case, r["worst_param"], r["max_rel_err"])
        assert r["shm_fallbacks"] == 0, case  # the outbox sized for every region's collectives
        if case.endswith("_optimize"):  # every region each rank ran planned after steps 2 and 4 (profiled 1, 3)
            assert {c["step"] for c in r["optimize"]} == {2, 4} and all("region" in c for c in r["optimize"]), r


def test_ranks_that_branch_apart_fail_together(capfd):
    """Rank 0 takes a branch that runs a layer of its own: every rank names what each runs, in
    about a second, far within the 20 s timeout."""
    code, out = _run(capfd, 2, "diverging-branch", timeout_s=120)
    assert code == 0, out
    assert ". A branch on a tensor's value went different ways on different ranks, and the regions after it run different collectives; keep what the step branches on the same on every rank (compute it from values every rank shares, or all_reduce it first)" in out  # noqa: E501
    said = re.findall(r"error: the ranks' steps diverged at a graph break: (rank 0 runs .*?); (rank 1 runs .*?)\. ",
                      out)
    assert len(said) == 2, out
    for rank0, rank1 in said:
        assert re.fullmatch(r"rank 0 runs region\d \(models\.py:\d+-\d+, after the break at line \d+\)", rank0), rank0
        assert rank1.startswith("rank 1 runs region"), rank1
    seconds = [float(s) for s in re.findall(r"rank \d answered in ([\d.]+) s", out)]
    assert len(seconds) == 2 and max(seconds) < 10, out


class _Moving(torch.nn.Module):
    """Its forward reads a Python int that changes at every call: Dynamo compiles the code
    after the break again each time."""

    def __init__(self):
        super().__init__()
        self.fc, self.calls = torch.nn.Linear(8, 8), 0

    def forward(self, x):
        h = self.fc(x)
        if h.mean().item() > 10:
            h = h + 1
        self.calls += 1
        return (h * self.calls).sum()


def _error(fn) -> str:
    with pytest.raises(dcir.DcirError) as e:
        fn()
    return e.value.render()


def test_what_regions_refuse_is_said():
    """What a step with breaks cannot do yet is an error that says what to change, not a
    traceback: offload and fp16 loss scaling need a whole-step program; a region's
    backward run twice; recompiles past the limit."""
    x = torch.randn(4, 8)
    for config, said in [({"offload": {"budget": 64}}, "the step has graph breaks, and 'offload' runs on a whole-step program: remove the breaks (dcir.graph_breaks lists them) or drop 'offload'"),  # noqa: E501
                         ({"fp16": {"enabled": True}}, "the step has graph breaks, and fp16's loss scaling needs a whole-step program: remove the breaks (dcir.graph_breaks lists them), or train in bf16")]:  # noqa: E501
        engine = dcir.initialize(BreakingNet(), config=config, loss_fn=squared)
        assert said in _error(lambda: engine(x))
    engine = dcir.initialize(BreakingNet(), config={}, loss_fn=squared)
    loss = engine(x)
    loss.backward(retain_graph=True)
    assert "a graph-break region's backward ran twice for one forward: its saved values are gone (call backward once per engine(...) call)" in _error(loss.backward)  # noqa: E501
    engine = dcir.initialize(_Moving(), config={"max_programs": 1})

    def steps():
        for _ in range(8):
            engine.backward(engine(x))
            engine.step()
    assert "the step's graph-break regions were compiled 4 times for one piece of the model's code (a new input shape or mode each time, or a branch's every value); pad or bucket the inputs to fewer shapes" in _error(steps)  # noqa: E501


def test_bf16_regions_run_the_whole_step_casts():
    """In bf16 the regions trace the step as the whole-step capture does (parameters and
    inputs in bf16, the optimizer's fp32 shards): a call Dynamo cannot trace trains exactly
    as the same computation traced in one graph does."""
    runs = {}
    for how in ("call", "inline"):
        torch.manual_seed(0)
        engine = dcir.initialize(BreakingNet(how), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                 config={"bf16": {"enabled": True}}, loss_fn=squared)
        losses = []
        for step in range(3):
            loss = engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[how] = (losses, engine.full_parameters(), len(engine.programs.modules()))
    (losses, params, regions), (whole_losses, whole_params, one) = runs["call"], runs["inline"]
    assert regions >= 2 and one == 1
    assert losses == whole_losses and all(torch.equal(params[n], whole_params[n]) for n in params)
    assert all(p.dtype == torch.float32 for p in params.values())


@torch._dynamo.disable
def log_scale(h):  # a call Dynamo cannot trace
    return h * h.norm().log1p()


class TwoRegions(torch.nn.Module):
    """docs/runtime.md's example, "Graph breaks: regions"."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = log_scale(h)  # the graph breaks around this call
        return self.fc2(h).sum()


def test_the_documented_two_region_ir_is_what_capture_makes():
    """docs/runtime.md shows the two modules of TwoRegions at world 2 after zero3: the text
    capture_region and the zero3 pass make, each a module dcir-opt reads as it is."""
    from dcir.passes.zero3 import Zero3
    from dcir_lowering.regions import capture_region

    model, modules = TwoRegions(), []

    def backend(gm, example_inputs):
        module, _ = capture_region(gm, list(example_inputs), model, f"region{len(modules)}", True)
        module.name = f"TwoRegions_region{len(modules)}"
        dcir.run_passes(module, [Zero3(world_size=2)])
        modules.append(module)
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=False)(torch.randn(2, 4))
    torch._dynamo.reset()
    doc = (HERE.parent / "docs" / "runtime.md").read_text()
    shown = doc.split("Their modules at world 2, after `zero3`", 1)[1].split("```text\n", 1)[1].split("\n```", 1)[0]
    assert shown == "\n".join(dcir.print(m).strip() + "\n" for m in modules).strip()
    for m in modules:
        assert str(dcir.parse(dcir.print(m))) == dcir.print(m)


def test_a_graph_dcir_cannot_capture_runs_eagerly(caplog):
    """The graph after the break writes into its input, which DCIR does not capture: it runs
    as Dynamo traced it, eagerly, its parameter gathered for it, and the log says why."""
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="dcir"):
        losses, ref_losses, worst, engine = _train(InPlaceNet(), 3, {}, lambda s: torch.randn(4, 8) * (s + 1))
    assert losses == ref_losses and worst == 0.0, (losses, ref_losses, worst)
    eager = engine.programs.regions.eager_regions  # the float .item() read: once static, once an input
    assert eager and all(re.fullmatch(r"region\d \(models\.py:\d+, after the break at line \d+\)", e) for e in eager)
    said = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(said) == 1 and " changes one of its inputs in place; DCIR runs a region as a function of its inputs: write the result to a new tensor" in said[0], said  # noqa: E501
