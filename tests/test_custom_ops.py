"""Custom operators (``torch.library``, outside ``aten``) carried through DCIR as opaque
compute ops: captured, printed, parsed, verified (result types from the fake kernel),
run through passes and the cost model, lowered and trained, in one process and at
world 2; and the ops DCIR refuses, each with a located error that says what to do.

The ops and the model are ``tests/custom_op_lib.py``'s."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcir
from custom_op_lib import GatedMLP, batches
from dcir import cli, ops as registry
from dcir.diagnostics import DcirError
from dcir.verifier import verify
from dcir_runtime import native
from dcir_runtime.launch import launch

HERE = Path(__file__).resolve().parent


def _captured(op: str = "gated_tanh"):
    torch.manual_seed(0)
    x, y = batches(1, 4)[0]
    return dcir.compile_to_ir(GatedMLP(op=op), (x, y))


@pytest.fixture(scope="module")
def text() -> str:
    return dcir.print(_captured())


def test_captured_custom_ops_print_parse_and_verify(text):
    assert "dcirtest.gated_tanh.default(%addmm, %primals_4) {scale = 0.75} : f32[4, 16]" in text
    assert "%getitem, %getitem_1 = dcirtest.gated_tanh_backward.default(" in text  # two results
    module = dcir.parse(text)
    assert dcir.print(module) == text
    verify(module, shapes=True)
    op = next(op for op in module.functions["forward"].ops if op.family == "dcirtest")
    assert registry.lookup(op.name) is registry.CUSTOM
    assert registry.has_trait(op, registry.COMPUTE) and registry.has_trait(op, registry.PURE)


def test_dcir_opt_runs_passes_and_the_cost_model_on_custom_ops(text, tmp_path):
    path = tmp_path / "gated.dcir"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([str(path), "--load", "custom_op_lib", "--passes", "zero3{world_size=2},prefetch,bucket"],
                    stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert "dcirtest.gated_tanh.default(" in out.getvalue() and "comm.all_gather" in out.getvalue()
    report = io.StringIO()
    assert cli.main([str(path), "--load", "custom_op_lib", "--simulate", "h100-ib400"], stdout=report,
                    stderr=err) == 0, err.getvalue()
    assert "step" in report.getvalue()


def test_dcir_opt_reads_a_captured_file_as_it_is_in_a_fresh_process(text, tmp_path):
    """The captured module names the Python module that registers its custom ops
    (attribute ``libraries``), which parsing imports: no ``--load``. Without the
    attribute, ``--load`` imports it; a named module that cannot be imported is a
    located error."""
    assert text.startswith('module @GatedMLP attributes {libraries = ["custom_op_lib"]} {'), text[:200]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def run(text, *extra):
        path = tmp_path / "gated.dcir"
        path.write_text(text)
        return subprocess.run([sys.executable, "-m", "dcir.cli", str(path), *extra], capture_output=True, text=True,
                              env=env, timeout=120)
    as_written = run(text)
    assert as_written.returncode == 0 and as_written.stdout == text, as_written.stderr
    bare = text.replace(' attributes {libraries = ["custom_op_lib"]}', "")
    without = run(bare)
    assert without.returncode == 1
    assert "no operator dcirtest::gated_tanh.default is registered with torch.library in this process" in \
        without.stderr
    assert "(dcir-opt --load MODULE)" in without.stderr
    loaded = run(bare, "--load", "custom_op_lib")
    assert loaded.returncode == 0 and loaded.stdout == bare, loaded.stderr
    missing = run(bare, "--load", "no_such_module_here")
    assert missing.returncode == 2 and "--load no_such_module_here: No module named" in missing.stderr
    gone = run(text.replace('"custom_op_lib"', '"no_such_module_here"'))
    assert gone.returncode == 1
    assert gone.stderr.startswith(f"{tmp_path / 'gated.dcir'}:1:1: error: the custom ops of @GatedMLP are registered "
                                  "by the Python modules its attribute 'libraries' names, and importing "
                                  "'no_such_module_here' failed: ModuleNotFoundError: No module named "
                                  "'no_such_module_here'; put the module on the path (PYTHONPATH), or drop the "
                                  "attribute and import the library with --load"), gone.stderr


def test_backend_trains_like_eager():
    torch.manual_seed(0)
    ref = GatedMLP()
    torch.manual_seed(0)
    mine = GatedMLP()
    compiled = torch.compile(mine, backend="dcir")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, mine)]
    torch._dynamo.reset()
    try:
        for x, y in batches(3, 4):
            for model, opt in zip((ref, compiled), opts):
                model(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch._dynamo.reset()
    for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(a, b), name  # the same ops on the same numbers: bit for bit


def test_program_trains_like_eager():
    torch.manual_seed(0)
    ref = GatedMLP()
    torch.manual_seed(0)
    mine = GatedMLP()
    x, y = batches(1, 4)[0]
    program = dcir.lower(dcir.parse(dcir.print(dcir.compile_to_ir(mine, (x, y)))),
                         {**dict(mine.named_parameters()), **dict(mine.named_buffers())})
    loss = program.train_step(x, y)
    expected = ref(x, y)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_engine_at_world_2_matches_eager(tmp_path):
    native.load()  # built once here, before the ranks start and load it
    out = tmp_path / "custom.json"
    code = launch([str(HERE / "custom_op_worker.py"), str(out)], 2, timeout_s=300, grace_s=5)
    assert code == 0 and out.exists()
    r = json.loads(out.read_text())
    assert r["ops"] == ["dcirtest.gated_tanh.default", "dcirtest.gated_tanh_backward.default"]
    assert r["worst"] <= 1e-6, f"{r['where']}: {r['worst']:.2e} relative to eager"


# ---- what DCIR refuses ------------------------------------------------------------------

def test_a_custom_op_without_a_fake_kernel_is_a_located_error():
    with pytest.raises(DcirError) as e:
        _captured("no_fake")
    message = str(e.value)
    assert "cannot capture the model as one graph: custom op dcirtest.no_fake.default has no fake kernel" in message
    assert 'register one with torch.library.register_fake("dcirtest::no_fake")' in message
    assert "custom_op_lib.py:" in message


def test_a_mutating_custom_op_is_refused_with_a_located_error():
    with pytest.raises(DcirError) as e:
        _captured("scale_")
    message = str(e.value)
    assert "cannot lower to DCIR: custom op dcirtest.scale_.default mutates its argument 'x' (mutates_args)" in message
    assert "DCIR carries custom ops as pure compute: return the new value instead" in message
    assert "custom_op_lib.py:" in message


_BAD = {
    "unknown namespace": ("%y = nosuchlib.op.default(%x) : f32[4, 16]",
                          "unknown op 'nosuchlib.op.default'; op families are: aten, comm, grad, mem, optim, param, rng "
                          "and custom ops, but no operator nosuchlib::op.default is registered with torch.library"),
    "no fake kernel": ("%y = dcirtest.no_fake.default(%x) : f32[4, 16]",
                       "custom op dcirtest.no_fake.default has no fake kernel"),
    "mutates": ("dcirtest.scale_.default(%x) {factor = 2.0}",
                "custom op dcirtest.scale_.default mutates its argument 'x'"),
    "fake kernel rejects": ("%y = dcirtest.gated_tanh.default(%x, %w) {scale = 1.0} : f32[4, 16]",
                            "the fake kernel of dcirtest.gated_tanh.default rejects these operands: gated_tanh: x's "
                            "last dimension must match w"),
    "wrong result type": ("%y = dcirtest.gated_tanh.default(%x, %v) {scale = 1.0} : f32[4, 8]",
                          "%y should have type f32[4, 16], but is declared f32[4, 8]"),
    "wrong attribute": ("%y = dcirtest.gated_tanh.default(%x, %v) {factor = 1.0} : f32[4, 16]",
                        "unknown attribute 'factor' for dcirtest.gated_tanh.default; its attributes are: scale"),
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_bad_custom_ops_in_text_are_located_errors(case):
    line, message = _BAD[case]
    text = f"module @m {{\n  func @f(%x: f32[4, 16], %w: f32[8], %v: f32[16]) {{\n    {line}\n    return\n  }}\n}}\n"
    with pytest.raises(DcirError) as e:
        verify(dcir.parse(text))
    rendered = e.value.render() if hasattr(e.value, "render") else str(e.value)
    assert message in rendered
    assert ":3:" in rendered  # located on the op's line
