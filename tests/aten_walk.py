"""The walk of ``tests/test_aten_vocab.py``: one OpInfo sample of torch's op database,
traced to aten (``make_fx``), lowered to DCIR, printed, parsed, verified, lowered back
to PyTorch, run and compared with eager."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import dcir
from dcir import aten
from dcir.ir import DType
from dcir.verifier import verify
from dcir_lowering.backend import lower_function
from dcir_lowering.program import constants, device_of
from dcir_lowering.dynamo import graph_to_module


class Untraceable(Exception):
    """``make_fx`` cannot trace the sample (not DCIR's business: the sample reads a
    tensor's value in Python, or needs a GPU)."""


class MetaGap(Exception):
    """The module verifies, but torch's meta kernel (``--verify-shapes``) rejects it or disagrees."""


@dataclass
class Walked:
    """What the walk of one op saw: argument forms (for coverage) and the ops it wrote."""

    forms: set[str] = field(default_factory=set)
    ops: set[str] = field(default_factory=set)


def full_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def samples(op, dtype: torch.dtype, limit: int | None):
    out = []
    for s in op.sample_inputs("cpu", dtype, requires_grad=False):
        out.append(s)
        if limit is not None and len(out) >= limit:
            break
    return out


def _program(op, sample):
    """The sample as a function of its tensors (the rest baked in), and those tensors."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def f(*tensors):
        filled = list(leaves)
        for i, t in zip(where, tensors):
            filled[i] = t
        first, args, kwargs = pytree.tree_unflatten(filled, spec)
        return [o for o in pytree.tree_leaves(op.op(first, *args, **kwargs)) if isinstance(o, torch.Tensor)]
    return f, [leaves[i] for i in where]


def walk_sample(op, sample, seen: Walked, *, random: bool) -> None:
    """Raises ``Untraceable``, ``DcirError`` (DCIR refuses), ``MetaGap`` or
    ``AssertionError`` (the lowered program computes something else)."""
    f, tensors = _program(op, sample)
    torch.manual_seed(0)
    try:
        expected = f(*tensors)
    except Exception as e:  # not runnable here at all (jiterator ops need a GPU)
        raise Untraceable(f"{type(e).__name__}: {str(e).strip()[:200]}") from None
    try:
        gm = make_fx(f)(*tensors)
    except Exception as e:  # torch's own tracer: .item(), data-dependent control flow, CUDA-only ops
        raise Untraceable(f"{type(e).__name__}: {str(e).strip()[:200]}") from None
    module, none_at = graph_to_module(gm, "f")
    text = dcir.print(module)
    parsed = dcir.parse(text)
    assert dcir.print(parsed) == text, "print -> parse -> print differs"
    verify(parsed)
    _record(parsed, seen)
    torch.manual_seed(0)
    got = list(lower_function(parsed, "f")(constants(parsed, device_of(tensors)), {}, *tensors))
    for i in none_at:
        got.insert(i, None)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        if random:  # a different draw, or memory never written: the same kind of tensor
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
        else:
            torch.testing.assert_close(b, a, equal_nan=True)
    try:
        verify(parsed, shapes=True)
    except dcir.DcirError as e:
        raise MetaGap(str(e)) from None


def _record(module, seen: Walked) -> None:
    """The argument forms the module's schema ops use, as ``schema type=kind``."""
    for func in module.functions.values():
        for op in func.ops:
            sch = aten.schema(op.name)
            if sch is None:
                continue
            seen.ops.add(op.name)
            plain = {k: v for k, v in op.attrs.items() if "." not in k}
            for arg, src in aten.bind(sch, len(op.operands), plain):
                if src[0] == "operands":
                    absent = op.attrs.get(f"{arg.name}.absent")
                    seen.forms.add(f"{arg.type}=operands" + ("+absent" if absent else ""))
                elif src[0] == "operand":
                    seen.forms.add(f"{arg.type}=operand")
                else:
                    seen.forms.add(f"{arg.type}={_kind(plain[src[1]])}")


def _kind(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, DType):
        return "dtype"
    if isinstance(value, tuple):
        return "list"
    if aten.is_complex_text(value):
        return "complex"
    return type(value).__name__
