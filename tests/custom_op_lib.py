"""Custom operators as a user writes them, and a small model that uses one; shared by
``tests/test_custom_ops.py``, its world-2 worker and ``dcir-opt --load custom_op_lib``.

``dcirtest::gated_tanh`` is what ``transformers``' mixture-of-experts layers look like to
DCIR: a ``torch.library.custom_op`` with a fake kernel and autograd, whose backward is a
second custom op with two results. Its body is a Python loop over rows, so no one can
trace into it: DCIR must carry it as one opaque op. ``dcirtest::no_fake`` (defined,
implemented for CPU, no fake kernel) and ``dcirtest::scale_`` (mutates its argument)
are the ones DCIR refuses.
"""

from __future__ import annotations

import torch

LIB = "dcirtest"


@torch.library.custom_op(f"{LIB}::gated_tanh", mutates_args=())
def gated_tanh(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(x)
    for i in range(x.shape[0]):  # row by row: opaque to every tracer
        out[i] = torch.tanh(x[i] * w) * scale
    return out


@gated_tanh.register_fake
def _(x, w, scale):
    torch._check(x.shape[-1] == w.shape[0], lambda: "gated_tanh: x's last dimension must match w")
    return torch.empty_like(x)


@torch.library.custom_op(f"{LIB}::gated_tanh_backward", mutates_args=())
def gated_tanh_backward(x: torch.Tensor, w: torch.Tensor, scale: float,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tanh(x * w)
    d = grad * scale * (1 - t * t)
    return d * w, (d * x).sum(0)


@gated_tanh_backward.register_fake
def _(x, w, scale, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w, scale = inputs
    ctx.save_for_backward(x, w)
    ctx.scale = scale


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw = gated_tanh_backward(x, w, ctx.scale, grad)
    return gx, gw, None


gated_tanh.register_autograd(_backward, setup_context=_setup)

_lib = torch.library.Library(LIB, "FRAGMENT")
_lib.define("no_fake(Tensor x) -> Tensor")
_lib.impl("no_fake", lambda x: torch.from_numpy(x.detach().numpy() * 2), "CPU")  # numpy: no tracer sees inside


@torch.library.custom_op(f"{LIB}::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, factor: float) -> None:
    x.mul_(factor)


@scale_.register_fake
def _(x, factor):
    return None


class GatedMLP(torch.nn.Module):
    """Linear -> a custom op (``gated_tanh`` with a parameter of its own, or one DCIR
    refuses, by name) -> Linear; returns its loss."""

    def __init__(self, features: int = 8, hidden: int = 16, op: str = "gated_tanh"):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.fc2 = torch.nn.Linear(hidden, features)
        self.op = op

    def forward(self, x, y):
        h = self.fc1(x)
        if self.op == "gated_tanh":
            h = gated_tanh(h, self.gate, 0.75)
        elif self.op == "no_fake":
            h = torch.ops.dcirtest.no_fake(h)
        else:
            h = h * 1.0
            scale_(h, 2.0)
        return torch.nn.functional.mse_loss(self.fc2(h), y)


def batches(steps: int, rows: int, features: int = 8, seed: int = 0):
    """``steps`` seeded (x, y) batches of ``rows`` rows."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, features, generator=g), torch.randn(rows, features, generator=g))
            for _ in range(steps)]
