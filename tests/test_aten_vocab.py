"""The whole aten vocabulary: every argument form aten schemas use can be written,
parsed and lowered. A walk over torch's op database (``op_db``, the OpInfos torch's
own tests use): each sample is traced to aten (``make_fx``), lowered to DCIR
(``GraphLowering``), printed, parsed, verified, lowered back to PyTorch, run and
compared with eager (``tests/aten_walk.py``).

The default run walks ``DEFAULT``, a subset chosen to cover every argument form (the
forms it must see are ``FORMS``, asserted); ``pytest -m slow`` walks every OpInfo in
four dtypes (float32, complex64, int64, bool), every sample (about 7 minutes on 2
cores). What fails is listed with its reason, and the lists are asserted both ways,
so a regression fails and so does a fix that leaves its entry behind:

* ``REFUSED``: DCIR refuses the op, with a located error (an element type DCIR lacks);
* ``META_GAPS``: the module verifies and runs, but ``--verify-shapes`` cannot check it,
  because torch's meta kernel is missing (data-dependent output shapes) or disagrees
  with its CPU kernel;
* ``UNTRACEABLE``: torch's tracer cannot trace the sample at all (it reads a tensor's
  value in Python) or it needs a GPU: nothing reaches DCIR.

``RANDOM`` ops (and the ``empty`` family, whose memory is never written) are compared
by shape and dtype; the rest with ``torch.testing.assert_close``'s defaults (the
lowered program calls the ops ``make_fx`` recorded, which for a composite op like
``linalg.pinv`` are its decomposition: the same numbers up to rounding).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dcir
from aten_walk import MetaGap, Untraceable, Walked, full_name, samples, walk_sample
from dcir.diagnostics import DcirError
from dcir_lowering.backend import lower_function
from dcir_lowering.dynamo import graph_to_module

F32, C64, I64, BOOL = torch.float32, torch.complex64, torch.int64, torch.bool

#: (OpInfo, dtype) walked by default, and the forms each stands for
DEFAULT = [
    ("addmm", F32),                              # Scalar beta/alpha as int and float
    ("addmm", C64),                              # Scalar as a complex number: {beta = "(1+2j)"}
    ("full", F32),                               # a Scalar value, dtype, layout, device, pin_memory
    ("cat", F32),                                # Tensor[]
    ("index_put", F32),                          # Tensor?[]
    ("__getitem__", F32),                        # Tensor?[] with absent entries: x[:, idx]
    ("sum", F32),                                # int[]? dim, bool keepdim, ScalarType? dtype
    ("nn.functional.conv2d", F32),               # Tensor? bias absent, SymInt[] stride/padding
    ("nn.functional.layer_norm", F32),           # optional weight and bias, float eps
    ("view", F32), ("expand", F32),              # SymInt[] sizes
    ("clone", F32),                              # MemoryFormat?
    ("to", F32),                                 # dtype, device, memory_format, copy
    ("div.floor_rounding", F32),                 # str? rounding_mode
    ("nn.functional.gelu", F32),                 # str approximate
    ("clamp", F32),                              # Scalar? min/max, Tensor? min/max
    ("split", F32), ("topk", F32),               # Tensor(a)[] and several results
    ("linalg.inv", F32),                         # an op that returns nothing (_linalg_check_errors)
    ("nn.functional.binary_cross_entropy", F32),  # an absent Tensor? before a given int: by keyword
    ("linalg.pinv", F32),                        # an absent Tensor? before a given Tensor?
    ("where", BOOL), ("argmax", I64),            # other element types
    ("nn.functional.softsign", F32),             # a number for a Tensor: torch wraps it ({other = 1})
    ("nn.functional.local_response_norm", F32),  # the same, a float
    ("_softmax_backward_data", F32),             # ScalarType input_dtype (an int in the schema)
    ("var", F32),                                # Scalar? correction
    ("logit", F32),                              # float? eps
    ("fill", F32),                               # a Scalar given as a boolean
    ("nn.functional.dropout", F32),              # random: compared by shape and dtype
    ("chalf", F32),                              # refused: complex32
]

#: the argument forms (``schema type=how it is written``) the default walk must write
FORMS = {
    "Tensor=operand", "Optional[Tensor]=operand", "Optional[Tensor]=none", "Tensor=float", "Tensor=int",
    "List[Tensor]=operands", "List[Optional[Tensor]]=operands", "List[Optional[Tensor]]=operands+absent",
    "int=int", "float=float", "bool=bool", "str=str", "Optional[str]=str", "Optional[float]=float",
    "number=int", "number=float", "number=complex", "Optional[number]=float",
    "number=bool", "List[int]=list", "Optional[List[int]]=list",
    "int=dtype", "Optional[int]=dtype", "Optional[int]=str", "Optional[Device]=str", "Optional[bool]=bool",
}

#: ops DCIR refuses, and what its error says
REFUSED = {
    "chalf": "argument 'dtype' of aten._to_copy.default is a torch.complex32, an element type DCIR does not have",
    "hash_tensor": "aten.hash_tensor.default returns what DCIR cannot hold: DCIR has no element type for "
                   "torch.uint64",
}

_NO_META = "attempted to run this operator with Meta tensors, but there was no fake impl or Meta kernel"
_NONZERO = "The register_meta function for torch.nonzero() raises unimplemented by default"
#: ops that verify and run, but that ``--verify-shapes`` cannot check (torch's meta kernels)
META_GAPS = {
    "masked_select": _NO_META, "combinations": _NO_META, "geqrf": _NO_META, "unique": _NO_META,
    "unique_consecutive": _NO_META, "histogram": _NO_META, "histogramdd": _NO_META, "bincount": _NO_META,
    "to_sparse": _NO_META, "nn.functional.ctc_loss": _NO_META, "linalg.lstsq": _NO_META,
    "linalg.lstsq.grad_oriented": _NO_META,
    "nonzero": _NONZERO, "argwhere": _NONZERO, "__getitem__": _NONZERO,  # a boolean mask index
    "repeat_interleave": "cannot repeat_interleave a meta tensor without output_size",
    # eval-mode batch norm: the CPU kernel returns empty saved statistics, the meta kernel full ones
    "native_batch_norm": "(torch's meta kernel for aten.native_batch_norm.default says so), but is declared f32[0]",
    "nn.functional.batch_norm": "(torch's meta kernel for aten.native_batch_norm.default says so)",
    "_native_batch_norm_legit": "(torch's meta kernel for aten._native_batch_norm_legit.default says so)",
    "nn.functional.embedding_bag": "(torch's meta kernel for aten._embedding_bag_forward_only.default says so)",
}

_VALUE = "It appears that you're trying to get value out of a tracing tensor"
#: samples torch's tracer cannot trace, or that need a GPU: nothing reaches DCIR
UNTRACEABLE = {
    **dict.fromkeys(["item", "allclose", "equal", "corrcoef", "cov", "istft", "narrow", "tensor_split",
                     "nn.functional.one_hot", "nn.functional.gaussian_nll_loss"], _VALUE),
    **dict.fromkeys(["sparse.sampled_addmm", "sparse.mm.reduce"], "Sparse CSR tensors do not have strides"),
    **dict.fromkeys(["jiterator_unary", "jiterator_binary", "jiterator_4inputs_with_extra_args",
                     "jiterator_binary_return_by_ref", "jiterator_2inputs_2outputs"],
                    "Jiterator is only supported on CUDA"),
}

#: draw random numbers (or return memory never written): compared by shape and dtype
RANDOM = {"bernoulli", "normal", "normal.number_mean", "rand_like", "randn_like", "randint", "randint_like", "randn",
          "multinomial", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
          "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
          "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
          "nn.functional.scaled_dot_product_attention", "nn.functional.multi_head_attention_forward",
          "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided",
          "pca_lowrank", "svd_lowrank"}


@functools.cache
def _op_db() -> dict:
    from torch.testing._internal.common_methods_invocations import op_db  # seconds: only when walking
    return {full_name(op): op for op in op_db}


def outcome(name: str, dtypes, limit: int | None, seen: Walked) -> str:
    """``ok``, or the first failure: ``refused: ...``, ``meta: ...``, ``untraceable: ...``, ``differs: ...``."""
    op = _op_db()[name]
    for dtype in dtypes:
        if dtype not in op.supported_dtypes("cpu"):
            continue
        for sample in samples(op, dtype, limit):
            try:
                walk_sample(op, sample, seen, random=name in RANDOM)
            except DcirError as e:
                return "refused: " + " ".join(str(e).split())
            except MetaGap as e:
                return "meta: " + " ".join(str(e).split())
            except Untraceable as e:
                return f"untraceable: {e}"
            except AssertionError as e:
                return f"differs ({dtype}): {' '.join(str(e).split())[:300]}"
    return "ok"


def _expected(name: str) -> tuple[str, str] | None:
    for kind, table in (("refused", REFUSED), ("meta", META_GAPS), ("untraceable", UNTRACEABLE)):
        if name in table:
            return kind, table[name]
    return None


def _check(name: str, got: str, *, every_sample: bool = True) -> None:
    want = _expected(name)
    if want is None:
        assert got == "ok", f"{name}: {got}"
        return
    kind, reason = want
    if got == "ok" and not every_sample:
        return  # the sample that fails is past the ones walked (__getitem__'s boolean mask)
    assert got.startswith(kind + ":") and reason in got, f"{name}: expected {kind} ({reason!r}), got: {got}"


class DefaultWalk:
    """The walk of ``DEFAULT``, each entry walked once, on first asking, into one ``Walked``:
    whichever test asks first, in whatever order, walks it (``-k`` included)."""

    def __init__(self):
        self.seen = Walked()
        self.outcomes: dict[tuple[str, torch.dtype], str] = {}

    def outcome(self, name: str, dtype: torch.dtype) -> str:
        if (name, dtype) not in self.outcomes:
            self.outcomes[name, dtype] = outcome(name, [dtype], 6, self.seen)
        return self.outcomes[name, dtype]

    def forms(self) -> set[str]:
        """The argument forms the whole of ``DEFAULT`` writes."""
        for name, dtype in DEFAULT:
            self.outcome(name, dtype)
        return self.seen.forms


@pytest.fixture(scope="module")
def default_walk() -> DefaultWalk:
    return DefaultWalk()


@pytest.mark.parametrize("name,dtype", DEFAULT, ids=[f"{n}-{str(d).removeprefix('torch.')}" for n, d in DEFAULT])
def test_default_subset_round_trips_and_runs(name, dtype, default_walk):
    _check(name, default_walk.outcome(name, dtype), every_sample=False)


def test_default_subset_writes_every_argument_form(default_walk):
    forms = default_walk.forms()
    assert FORMS <= forms, f"forms not written: {sorted(FORMS - forms)}"


@pytest.mark.slow
def test_whole_op_database():
    seen, got = Walked(), {}
    for name in _op_db():
        got[name] = outcome(name, (F32, C64, I64, BOOL), None, seen)
    failures = []
    for name, result in got.items():
        try:
            _check(name, result)
        except AssertionError as e:
            failures.append(str(e))
    listed = {**REFUSED, **META_GAPS, **UNTRACEABLE}
    failures += [f"{name}: listed, but not in torch's op database" for name in listed if name not in got]
    assert not failures, "\n".join(failures)
    assert sum(r == "ok" for r in got.values()) >= 640, "fewer OpInfos walk cleanly than measured (658 of 702)"


# ---- forms no OpInfo sample writes ---------------------------------------------------------


def _lowered(fn, *inputs, mode: str = "real"):
    gm = make_fx(fn, tracing_mode=mode)(*inputs)
    module, _ = graph_to_module(gm, "f")
    text = dcir.print(module)
    parsed = dcir.parse(text)
    dcir.verify(parsed)
    return text, lower_function(parsed, "f")


def test_a_complex_number_for_a_tensor_argument():
    x = torch.randn(2, 3, dtype=torch.complex64)
    text, run = _lowered(lambda x: [x * (1 + 2j) + 0.5j], x)
    assert '{other = "(1+2j)"}' in text and '{other = "0.5j"}' in text
    assert torch.equal(run({}, {}, x)[0], x * (1 + 2j) + 0.5j)


def test_a_layout_and_a_memory_format_are_names():
    x = torch.randn(2, 3, 4, 5)
    text, run = _lowered(lambda x: [torch.zeros_like(x, layout=torch.strided, memory_format=torch.channels_last)], x)
    assert 'layout = "strided"' in text and 'memory_format = "channels_last"' in text
    assert run({}, {}, x)[0].is_contiguous(memory_format=torch.channels_last)


def test_a_generator_is_refused():
    """A ``torch.Generator`` is state, not a value: DCIR refuses it and says why (torch's
    tracers refuse it first; a hand-built graph reaches DCIR)."""
    import types

    import torch.fx as fx
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.rand(3)
    y = g.call_function(torch.ops.aten.bernoulli.default, (x,), {"generator": torch.Generator()})
    y.meta["val"] = torch.rand(3)
    g.output([y])
    with pytest.raises(DcirError, match="argument 'generator' of aten.bernoulli.default is a torch.Generator: a "
                                        "generator is state that DCIR does not carry"):
        graph_to_module(types.SimpleNamespace(graph=g), "f")  # a GraphModule cannot even print that call


def test_a_sparse_result_is_refused():
    with pytest.raises(DcirError, match="DCIR values are dense tensors; the graph has a torch.sparse_coo tensor"):
        _lowered(lambda x: [x.to_sparse() * 2], torch.rand(2, 3), mode="fake")


def test_an_element_type_dcir_lacks_is_refused():
    with pytest.raises(DcirError, match="is a torch.uint16, an element type DCIR does not have"):
        _lowered(lambda x: [x.to(torch.uint16)], torch.rand(2, 3))
    with pytest.raises(DcirError, match="DCIR has no element type for torch.uint16; its element types are: bool, u8"):
        _lowered(lambda x: [x], torch.zeros(2, dtype=torch.uint16))
