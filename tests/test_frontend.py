"""Capture: a model's training step becomes a valid DCIR module, and the model is
left as it was."""

from __future__ import annotations

import pytest
import torch

import dcir
from models import Breaks, ConvBN, Tied


def _check(module: dcir.Module) -> str:
    dcir.verify(module, shapes=True)
    text = dcir.print(module)
    assert dcir.print(dcir.parse(text)) == text  # dcir-opt accepts it unchanged
    return text


def _ops(module, func, name):
    return [op for op in module.functions[func].ops if op.name == name]


def test_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    m = dcir.compile_to_ir(model, (torch.randn(4, 8),), loss_fn=lambda out: out.pow(2).mean(), name="mlp")
    _check(m)
    assert list(m.decls) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(d.trainable for d in m.decls.values())
    assert sorted(op.symbol for op in _ops(m, "backward", "grad.set")) == sorted(m.decls)
    assert m.functions["forward"].result_types[0] == dcir.parse("module @m {\n  func @f(%x: f32[]) {\n    return\n  }\n}\n"
                                                                ).functions["f"].args[0].type
    assert all(p.grad is None for p in model.parameters())


def test_cnn_with_batchnorm_and_a_frozen_parameter():
    torch.manual_seed(0)
    model = ConvBN()
    before = model.bn.running_mean.clone()
    m = dcir.compile_to_ir(model, (torch.randn(2, 3, 8, 8), torch.tensor([0, 1])))
    _check(m)
    written = sorted(op.symbol for op in _ops(m, "forward", "param.set"))
    assert written == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    assert m.decls["bn.running_mean"].kind == "buffer"
    assert not m.decls["bn.weight"].trainable
    assert "bn.weight" not in {op.symbol for op in _ops(m, "backward", "grad.set")}
    assert torch.equal(model.bn.running_mean, before)  # the caller's model is untouched


def test_tied_weights_are_one_symbol_with_one_gradient():
    m = dcir.compile_to_ir(Tied(), (torch.tensor([[1, 2, 3]]),))
    _check(m)
    assert list(m.decls) == ["embed.weight", "mix.weight", "mix.bias"]
    assert not m.decls["mix.weight"].trainable
    assert [op.symbol for op in _ops(m, "backward", "grad.set")] == ["embed.weight", "mix.bias"]


def test_a_graph_break_is_a_located_error():
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(Breaks(), (torch.randn(2, 4),))
    message = e.value.render()
    assert message.startswith("error: cannot capture the model as one graph:")
    assert "models.py:" in message  # where the break is, in the model's source


def test_a_step_without_a_loss_is_an_error():
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    message = "the step must produce a scalar loss that requires grad; pass loss_fn= to compute it from the model's output"
    assert e.value.render() == "error: " + message


class Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return {"logits": self.fc(x)}


def test_an_output_without_a_loss_is_an_error():
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(Named(), (torch.randn(2, 4),))
    assert "cannot find a loss in the model's output (dict); pass loss_fn=" in e.value.render()


def test_only_tensors_are_values():
    from dcir_lowering.frontend import _type
    with pytest.raises(dcir.DcirError, match="DCIR values are tensors; the graph has a int value"):
        _type(3)


class BigConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5000, 1)

    def forward(self, x):
        return self.fc(x * torch.tensor([0.5] * 5000)).mean()


def test_an_inexpressible_construct_is_a_located_error():
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(BigConstant(), (torch.randn(2, 5000),))
    message = e.value.render()
    assert message.startswith("error: cannot lower to DCIR: a constant tensor of 5000 elements (more than 4096); "
                              "register it as a buffer of the model")
    assert "test_frontend.py:" in message
