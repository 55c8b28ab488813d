"""Listing graph breaks: ``dcir.graph_breaks``, ``dcir-train --list-breaks`` and the
whole-graph capture error that lists every break with its line."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import dcir
from dcir.activations import RECOMPUTE
from dcir_lowering.breaks import _KERNEL_FUNCS, GraphBreak, breaks_of, notes
from dcir_runtime.train import breaks_table
from zoo import ZOO

_log = logging.getLogger("dcir.test_breaks")


def line_of(text: str) -> int:
    """The first line of this file that holds ``text``: the models come first."""
    return next(k for k, line in enumerate(open(__file__).read().splitlines(), 1) if text in line)


class ItemBranch(torch.nn.Module):
    """A branch on a value read out of a tensor with ``.item()``; BatchNorm so a changed
    running statistic would show."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.fc(x))
        if h.mean().item() > -1e9:  # data-dependent: Dynamo cannot know which way
            h = h * 2
        return h.pow(2).mean()


class Locked(torch.nn.Module):
    """A Python construct Dynamo cannot trace (transformers' hook installation takes a lock)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        with threading.Lock():
            h = h + 1
        return h.pow(2).mean()


class TwoBreaks(torch.nn.Module):
    """A ``.item()`` read and, later, a branch on a tensor."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        scale = h.abs().max().item()
        h = h / (scale + 1)
        if h.sum() > -1e9:
            h = torch.tanh(h)
        return h.pow(2).mean()


class Chatty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        _log.warning("Chatty.forward on %s rows", x.shape[0])
        warnings.warn("Chatty warns", UserWarning)
        h = self.fc(x)
        print("Chatty prints", h.shape)
        return h.pow(2).mean()


KERNELS = importlib.util.find_spec("kernels") is not None  # what transformers needs since 5.25
if KERNELS:
    import kernels

    @kernels.use_kernel_forward_from_hub("DcirTestScale")
    def scale(h):
        return h * 2

    @kernels.use_kernelized_func(scale)
    class Kernelized(torch.nn.Module):
        """A block calling a hub-kernel function, as transformers' attention calls
        ``apply_rotary_pos_emb``: its forward sets and resets ``kernels``' table."""

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, h):
            return scale(torch.tanh(self.fc(h)))


class Checkpointed(torch.nn.Module):
    """Two ``Kernelized`` blocks, each recomputed in the backward (non-reentrant
    checkpointing, as ``gradient_checkpointing_enable()`` sets it up) unless ``plain``."""

    def __init__(self, plain: bool = False):
        super().__init__()
        self.blocks, self.plain = torch.nn.ModuleList([Kernelized(), Kernelized()]), plain

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.plain else torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x.pow(2).mean()


def test_an_item_branch_is_listed_with_its_line_and_the_model_is_untouched():
    torch.manual_seed(0)
    model = ItemBranch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = dcir.graph_breaks(model, torch.randn(8, 4))
    line = line_of("if h.mean().item() > -1e9:")
    assert [(b.file, b.line) for b in found] == [(__file__, line)]
    b = found[0]
    assert b.reason == "Tensor.item() reads a tensor's value into Python"
    assert b.source == "if h.mean().item() > -1e9:"  # the comment is not part of it
    assert str(b) == f"test_breaks.py:{line}: Tensor.item() reads a tensor's value into Python " \
                     "(if h.mean().item() > -1e9:)"
    assert found.graphs == 2
    # the caller's model: no gradients, BatchNorm's statistics as they were
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.line = 1


def test_an_unsupported_python_construct_is_listed():
    found = dcir.graph_breaks(Locked(), torch.randn(2, 4))
    line = line_of("with threading.Lock():")
    assert [(b.line, b.source) for b in found] == [(line, "with threading.Lock():")]
    assert found[0].reason == "a call Dynamo does not trace"


def test_logging_warnings_and_print_are_not_breaks(capsys):
    found = dcir.graph_breaks(Chatty(), torch.randn(2, 4))
    assert found == [] and found.graphs == 1
    assert "Chatty prints" not in capsys.readouterr().out  # ignored while traced


@pytest.mark.skipif(not KERNELS, reason="the kernels package is not installed")
def test_kernels_function_table_is_not_a_break_under_checkpointing():
    """``kernels``' table of a model's function wrappers, written in every forward of a
    block that calls a hub-kernel function, is a write Dynamo refuses inside a
    checkpointed region; with no function ``kernelize`` replaced it changes nothing that
    runs, so it is no break, the step is one graph and the blocks are recomputed. The
    package keeps its own table outside the capture."""
    table = getattr(sys.modules[_KERNEL_FUNCS[0]], _KERNEL_FUNCS[1])
    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(3, 4)
    found = dcir.graph_breaks(model, x)
    assert found == [] and found.graphs == 1, [str(b) for b in found]
    module = dcir.compile_to_ir(model, (x,))
    assert any(RECOMPUTE in op.attrs for op in module.functions["backward"].ops)
    assert getattr(sys.modules[_KERNEL_FUNCS[0]], _KERNEL_FUNCS[1]) is table


@pytest.mark.skipif(not KERNELS, reason="the kernels package is not installed")
def test_a_function_kernelize_replaced_still_runs_its_kernel():
    """Where ``kernelize`` replaced a function (here by hand, as it does: the model's
    private wrapper gets another ``forward``), the captured step runs the replacement,
    not the plain function."""
    from types import MethodType

    model = Checkpointed(plain=True)
    wrapper = model.blocks[1]._kernel_funcs["DcirTestScale"]  # the function's layer name
    wrapper.forward = MethodType(lambda self, h: torch.sigmoid(h), wrapper)
    ops = [op.name for op in dcir.compile_to_ir(model, (torch.randn(3, 4),)).functions["forward"].ops]
    assert ops.count("aten.sigmoid.default") == 1 and ops.count("aten.mul.Tensor") >= 1, ops


def test_a_transformers_model_has_no_breaks():
    z = ZOO["llama"]
    inputs, y = z.batch(torch.Generator().manual_seed(0), 2)
    found = dcir.graph_breaks(z.model(), **inputs, labels=y)
    assert found == [] and found.graphs == 1


def test_the_whole_graph_error_lists_every_break_with_its_line():
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(TwoBreaks(), (torch.randn(2, 4),))
    message = e.value.render()
    assert message.startswith("error: cannot capture the model as one graph: ")
    assert "2 graph breaks in the step, which runs as" in message
    first, second = line_of("scale = h.abs().max().item()"), line_of("if h.sum() > -1e9:")
    assert f"note: {__file__}:{first}: Tensor.item() reads a tensor's value into Python " \
           "(scale = h.abs().max().item())" in message
    assert f"note: {__file__}:{second}: data-dependent branching on a tensor (if h.sum() > -1e9:)" in message


def test_the_error_lists_ten_breaks_then_how_many_more():
    model = TwoBreaks()
    listed = notes(model, (torch.randn(2, 4),), {}, limit=1)
    assert [n.message for n in listed[2:]] == ["and 1 more"]
    assert f":{line_of('scale = h.abs().max().item()')}: " in listed[1].message
    assert notes(Chatty(), (torch.randn(2, 4),), {}) == ()  # no breaks, no notes


def test_breaks_of_a_function_outside_a_module():
    def step(x):
        if x.sum() > 0:
            return x * 2
        return x

    found = breaks_of(step, (torch.ones(3),), {})
    assert [b.source for b in found] == ["if x.sum() > 0:"]
    assert found[0].reason == "data-dependent branching on a tensor"


def test_the_table_lists_location_reason_and_source():
    table = breaks_table(dcir.graph_breaks(TwoBreaks(), torch.randn(2, 4))).splitlines()
    assert table[0].split() == ["file:line", "reason", "source"]
    assert table[1].startswith(f"{__file__}:{line_of('scale = h.abs().max().item()')} ")
    assert table[1].endswith("  scale = h.abs().max().item()")
    assert table[-2] == "2 graph breaks: the forward runs as 3 graph(s) and Python between them"
    assert table[-1].startswith("the Engine trains each graph as a sharded region of its own and runs the Python ")
    assert breaks_table([]) == "no graph breaks: the step is one graph"
    assert str(GraphBreak("r", "/a/f.py", 1, "")) == "f.py:1: r"  # no source: no parentheses


def test_dcir_train_lists_breaks():
    help_text = subprocess.run([sys.executable, "-m", "dcir_runtime.train", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "--list-breaks" in help_text
    proc = subprocess.run([sys.executable, "-m", "dcir_runtime.train", "--list-breaks", "--layers", "1", "--hidden",
                           "32", "--seq", "16", "--batch", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "no graph breaks: the step is one graph"
