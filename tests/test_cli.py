"""dcir-opt as a user meets it: exit codes, no tracebacks, options that work."""

from __future__ import annotations

import io
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

import dcir
from dcir.cli import main
from dcir.ir import Value
from dcir.passes import Pass, PassManager
from dcir.passes.canonicalize import Canonicalize

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "mlp.dcir"


def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_no_passes_reprints():
    code, out, err = run(str(MLP))
    assert (code, err) == (0, "")
    assert out == MLP.read_text()


def test_stdin_and_output_file(tmp_path):
    target = tmp_path / "out.dcir"
    code, out, err = run("-", "-o", str(target), "--passes", "dce", stdin=MLP.read_text())
    assert (code, out, err) == (0, "", "")
    assert target.read_text() == MLP.read_text()


def test_bad_input_exits_1_with_a_located_error():
    proc = subprocess.run([sys.executable, "-m", "dcir.cli", "-"], input="module @m {\n  param @w f32[2]\n}\n",
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("<stdin>:2:12: error: a declaration is `param @name : type`")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--no-such-flag"], ["--passes", "nope"], ["/no/such/file.dcir"],
                                  ["--help-pass", "nope"]])
def test_bad_usage_exits_2(argv):
    proc = subprocess.run([sys.executable, "-m", "dcir.cli", *argv], capture_output=True, text=True, input="")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip()


def test_help_lists_passes_and_help_pass_describes_one():
    proc = subprocess.run([sys.executable, "-m", "dcir.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "canonicalize" in proc.stdout and "dce" in proc.stdout
    code, out, _ = run("--help-pass", "canonicalize")
    assert code == 0 and "max_iterations = 10" in out and "->" in out


def test_time_passes_and_print_ir_after_all():
    code, out, err = run(str(MLP), "--passes", "dce,canonicalize", "--time-passes", "--print-ir-after-all")
    assert code == 0
    assert "// -----// IR Dump After dce //----- //" in err
    assert "// -----// IR Dump After canonicalize //----- //" in err
    for phase in ("parse", "verify", "dce", "canonicalize", "print", "total"):
        assert phase in err.split("pass execution timing report")[1]


def test_disable_verify_accepts_invalid_module():
    text = "module @m {\n  func @f() {\n    %y = aten.relu.default(%nope) : f32[4]\n    return\n  }\n}\n"
    assert run("-", stdin=text)[0] == 1
    code, out, _ = run("-", "--disable-verify", stdin=text)
    assert code == 0 and out == text


def test_split_input_file_keeps_line_numbers():
    text = "module @a {\n}\n// -----\nmodule @b {\n  param @w f32[2]\n}\n"
    code, out, err = run("-", "--split-input-file", stdin=text)
    assert code == 1
    assert err.startswith("<stdin>:5:12:")


def test_verify_diagnostics_reports_mismatches():
    text = "module @m {\n  // expected-error @+1 {{this is not the message}}\n  param @w f32[2]\n}\n"
    code, _, err = run("-", "--verify-diagnostics", stdin=text)
    assert code == 1
    assert "unexpected error (line 3)" in err and "was not produced: this is not the message" in err


@dataclass(frozen=True)
class _BreaksSSA(Pass):
    """A deliberately broken pass: an operand now names a value nothing defines."""

    name = "breaks_ssa"

    def run(self, module, stats: Counter, ctx) -> None:
        func = module.functions["forward"]
        func.ops[2].operands = [Value("gone", func.ops[0].results[0].type), *func.ops[2].operands[1:]]


def test_invalid_pass_output_is_caught_with_a_reproducer(tmp_path):
    module = dcir.parse(MLP.read_text(), str(MLP))
    repro = tmp_path / "repro.dcir"
    with pytest.raises(dcir.DcirError) as e:
        PassManager([_BreaksSSA()], reproducer=repro).run(module)
    text = e.value.render()
    assert "error: pass 'breaks_ssa' produced invalid IR:" in text
    assert "use of undefined value %gone" in text
    assert f"reproducer written to {repro} (run it with: dcir-opt {repro} --passes 'breaks_ssa')" in text
    saved = repro.read_text()
    assert saved.startswith("// RUN: dcir-opt %s --passes 'breaks_ssa'\n")
    assert dcir.parse(saved) == dcir.parse(MLP.read_text())  # the pass's input, as it was


_FOLDABLE = """module @m {
  func @f(%x: f32[4, 16], %w: f32[16, 8]) -> (f32[4, 8]) {
    %t = aten.t.default(%w) : f32[8, 16]
    %tt = aten.t.default(%t) : f32[16, 8]
    %v = aten.view.default(%tt) {size = [16, 8]} : f32[16, 8]
    %y = aten.mm.default(%x, %v) : f32[4, 8]
    return %y
  }
}
"""


def test_run_passes_api():
    """``dcir.run_passes`` rewrites the module it is given, in place, and returns it; a
    pipeline written as text (options included) and one given as pass instances agree."""
    module = dcir.parse(_FOLDABLE)
    assert dcir.run_passes(module, "canonicalize{max_iterations=2}") is module
    assert dcir.print(module) == """module @m {
  func @f(%x: f32[4, 16], %w: f32[16, 8]) -> (f32[4, 8]) {
    %y = aten.mm.default(%x, %w) : f32[4, 8]
    return %y
  }
}
"""
    assert dcir.run_passes(dcir.parse(_FOLDABLE), [Canonicalize(max_iterations=2)]) == module
