"""Passes and models ask traits, not op names: a new op declared with the traits of
an existing one flows through them unchanged.

The test registers, for its own duration only, ``param.read`` (the traits and type
rule of ``param.get``) and ``comm.gather_into`` (those of ``comm.all_gather``), then
runs the same program spelled with the new ops and with the old ones: ``zero3``,
``prefetch`` (with its fusing, which is ``bucket``'s merge) and the verifier treat
them alike, op for op.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

import dcir
from dcir import ops
from dcir.verifier import diagnostics

GOLDEN = Path(__file__).parent / "golden" / "passes"


@contextmanager
def _registered_new_ops():
    defs = [replace(ops.OPS["param.get"], name="param.read", example=""),
            replace(ops.OPS["comm.all_gather"], name="comm.gather_into", example="")]
    for d in defs:
        assert d.name not in ops.OPS
        ops.OPS[d.name] = d
    try:
        yield
    finally:
        for d in defs:
            del ops.OPS[d.name]


@pytest.fixture
def new_ops():
    with _registered_new_ops():
        yield


def _chunk(path: Path, label: str) -> str:
    return next(c for c in path.read_text().split("// -----") if f"module @{label}" in c)


def _run(text: str, pipeline: str) -> str:
    module = dcir.parse(text, "m.dcir")
    assert not diagnostics(module), [d.message for d in diagnostics(module)]
    return str(dcir.run_passes(module, pipeline))  # verifies after each pass


def test_a_new_state_read_is_sharded_by_zero3(new_ops):
    text = _chunk(GOLDEN / "zero3.dcir", "linear")
    old = _run(text, "zero3")
    new = _run(text.replace("param.get @", "param.read @"), "zero3")
    assert "comm.all_gather" in new and "param.read @fc.weight : shard<f32[4, 8], 2>" in new
    assert new == old.replace("param.get @", "param.read @")


def test_a_new_gather_is_hoisted_and_fused_by_prefetch(new_ops):
    text = _chunk(GOLDEN / "prefetch.dcir", "budget")
    old = _run(text, "prefetch")
    new = _run(text.replace("comm.all_gather(", "comm.gather_into("), "prefetch")
    assert "comm.all_gather_coalesced(%w1_shard, %w2_shard)" in old  # fused: the merge ran on the new op too
    assert new == old.replace("comm.all_gather(", "comm.gather_into(")
    stopped = "prefetch: all_gather moved"
    stats_old, stats_new = dcir.passes.PassManager(dcir.passes.parse_pipeline("prefetch{fuse=false}")), \
        dcir.passes.PassManager(dcir.passes.parse_pipeline("prefetch{fuse=false}"))
    stats_old.run(dcir.parse(text))
    stats_new.run(dcir.parse(text.replace("comm.all_gather(", "comm.gather_into(")))
    assert any(k.startswith(stopped) for k in stats_new.stats["prefetch{fuse=false}"])
    assert stats_new.stats == stats_old.stats


def test_the_verifier_checks_a_new_gather_like_the_old(new_ops):
    bad = """module @m attributes {world_size = 2} {
  param @w : shard<f32[8], 2>
  func @f() -> (f32[8]) {
    %w = param.read @w : shard<f32[8], 2>
    %p = comm.gather_into(%w) : pending<f32[8]>
    %y = aten.relu.default(%p) : f32[8]
    %w_full = comm.wait(%p) : f32[8]
    return %y
  }
}
"""
    messages = [d.message for d in diagnostics(dcir.parse(bad, "m.dcir"))]
    assert messages == [m.replace("comm.all_gather", "comm.gather_into") for m in
                        (d.message for d in diagnostics(dcir.parse(
                            bad.replace("comm.gather_into", "comm.all_gather").replace("param.read", "param.get"),
                            "m.dcir")))]
    assert any("only comm.wait can consume a pending value" in m for m in messages)


def test_an_op_taken_out_of_the_registry_is_unknown_again():
    """The registry is left as it was: an op looked up while registered (the parser and
    the verifier cache what they can) is unknown once taken out, and the verifier says so."""
    text = _chunk(GOLDEN / "zero3.dcir", "linear").replace("param.get @", "param.read @")
    with _registered_new_ops():
        assert ops.lookup("param.read") is not None and ops.lookup("comm.gather_into") is not None
        assert not diagnostics(dcir.parse(text, "m.dcir"))
    assert ops.lookup("param.read") is None and ops.lookup("comm.gather_into") is None
    with pytest.raises(dcir.DcirError, match="unknown op 'param.read'"):
        dcir.verify(dcir.parse(text, "m.dcir"))
