"""Capture: a model's training step becomes a valid DCIR module, and the model is
left as it was."""

from __future__ import annotations

import copy

import pytest
import torch

import dcir
import dcir_lowering.dynamo as dcir_dynamo
from dcir_lowering.program import state_of
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


class Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"logits": y, "argmax": y.argmax(-1), "pair": (y.sum(), 3)}


def test_the_outputs_are_the_models_and_each_differentiable_one_gets_a_gradient():
    from dcir import signature
    from dcir_lowering.frontend import capture

    model, x = Named(), torch.randn(2, 4)
    module, outputs = capture(model, (x,))
    fw, bw = module.role("forward"), module.role("backward")
    assert [str(t) for t, d in zip(fw.result_types, fw.result_attrs) if "output" in d] == ["f32[2, 4]", "i64[2]", "f32[]"]
    assert sorted(k for _, k in signature.grads(bw)) == [0, 2]  # argmax has no gradient
    values = [torch.ones(2, 4), torch.zeros(2, dtype=torch.long), torch.tensor(5.0)]
    out = outputs.rebuild(values)
    assert set(out) == {"logits", "argmax", "pair"} and out["logits"] is values[0] and out["pair"] == (values[2], 3)
    assert "role forward" in dcir.print(module) and '{input = "args[0]"}' in dcir.print(module)


def test_a_model_whose_outputs_need_no_gradient_is_an_error():
    model = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(model, (torch.randn(2, 4),))
    message = "no output of the model requires grad: there is nothing to train (are the parameters frozen, or the step run under torch.no_grad()?)"  # noqa: E501
    assert e.value.render() == "error: " + message


def test_an_input_that_requires_grad_is_an_error():
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(torch.nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),))
    assert "an input of the model requires grad (torch.float32, shape [2, 4]); " in e.value.render()
    assert "); DCIR trains the model's parameters and gives inputs no gradient: pass it detached, or make it a parameter of the model" in e.value.render()  # noqa: E501


def test_a_returned_parameter_is_an_error():
    class Returns(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return (x * self.w).sum(), self.w

    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(Returns(), (torch.randn(4),))
    assert "that its forward does not compute (an input or a parameter returned as it is); return a computed " \
        "value instead" in e.value.render()


def test_eval_capture_is_a_forward_alone():
    from dcir_lowering.frontend import capture

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).eval()
    module, _ = capture(model, (torch.randn(2, 4),), training=False)
    assert list(module.functions) == ["eval"] and module.role("eval").role == "eval"
    assert "aten.native_dropout" not in dcir.print(module)


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


class Window:
    """Holds a slice of a computed tensor, as a sliding-window KV cache does."""

    def __init__(self, kept):
        self.kept = kept


class Slides(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)

    def forward(self, x):
        y = self.fc(x)
        return y.sum(), Window(y[:, 2:])


def test_an_output_object_holding_a_view_is_rebuilt_as_a_view():
    """The object's tensor is not one the graph returns but the same view of it (Dynamo
    rebuilt it): it gets the program's output, not a copy (deepcopy refuses non-leaves)."""
    from dcir_lowering.frontend import capture
    from dcir_lowering.outputs import _ViewSlot

    module, outputs = capture(Slides(), (torch.randn(3, 4),))
    values = [dcir_values(t.type) for t in signature_outputs(module)]
    loss, window = outputs.rebuild(values)
    assert window.kept is next(v for v in values if v.dim() == 2)
    assert loss is next(v for v in values if v.dim() == 0)
    # a narrower view of an output is rebuilt as that view of the program's output
    base = torch.arange(12.0).reshape(3, 4)
    rebuilt = type(outputs)({"window": _ViewSlot(0, (2, 2), (4, 1), 1)}).rebuild([base])["window"]
    assert torch.equal(rebuilt, base[:2, 1:3]) and rebuilt.untyped_storage().data_ptr() == base.data_ptr()


def signature_outputs(module):
    from dcir import signature
    return signature.results(module.role("forward"), signature.OUTPUT)


def dcir_values(t):
    from dcir.shapes import torch_dtype
    return torch.arange(float(torch.Size(t.shape).numel())).reshape(t.shape).to(torch_dtype(t.dtype))


CAPTURE_LARGER_THAN_THIS_MACHINE = """
import json, resource, torch, dcir
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=128000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=4,
                     num_attention_heads=64, num_key_value_heads=8, attn_implementation="eager")
with torch.device("meta"):
    model = LlamaForCausalLM(config)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
ids = torch.randint(0, 128000, (1, 16))
module = dcir.compile_to_ir(model, (), kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out: out.loss)
print(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                  "roles": sorted(f.role for f in module.functions.values()),
                  "grown_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before}))
"""


def test_capture_of_a_model_larger_than_this_machine_allocates_none_of_it():
    """A 5.5 B-parameter Llama on the meta device (22 GiB of fp32 parameters, more with
    gradients than the machine has) is captured on fake tensors: the process grows by
    less than 1% of the parameters' bytes."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CAPTURE_LARGER_THAN_THIS_MACHINE], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["params"] > 5e9 and r["roles"] == ["backward", "forward"], r
    assert r["grown_mib"] < 0.01 * 4 * r["params"] / 2**20, r


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_warms_up_on_real_tensors_and_captures(name):
    """A fresh MoE model installs its router-logit hooks on its first call (a lock Dynamo
    cannot enter): capture's eager warm-up runs it on real tensors in place of the fake
    parameters (on fakes transformers takes its grouped_mm path, which fails), and the
    captured step's loss is the eager model's."""
    from dcir_lowering.program import state_of
    from dcir_lowering.frontend import capture
    from zoo import ZOO

    def loss_fn(out):
        return out.logits.pow(2).mean()
    model = ZOO[name].model()
    kwargs, _ = ZOO[name].batch(torch.Generator().manual_seed(1), 2)
    module, _ = capture(model, (), kwargs=kwargs, loss_fn=loss_fn)
    loss = dcir.lower(module, state_of(model)).train_step(**kwargs)
    assert torch.equal(loss, loss_fn(ZOO[name].model()(**kwargs)))


class _Attention(torch.nn.Module):
    """Softmax weights through dropout at p=0 in training (what AOTAutograd traces as a
    clone), then used; ``expose`` also returns the weights' copy as a model output."""

    def __init__(self, expose: bool = False):
        super().__init__()
        self.proj, self.expose = torch.nn.Linear(8, 8), expose

    def forward(self, x):
        weights = self.proj(x).softmax(-1)
        dropped = torch.nn.functional.dropout(weights, p=0.0, training=True)
        out = (dropped @ x.t()).pow(2).mean()
        return (out, dropped) if self.expose else out


def test_a_copy_that_copies_nothing_is_folded():
    """dropout(p=0)'s clone is gone from the forward (the backward's saved values are the
    softmax's, once); a copy the model returns stays a copy, and the step still trains
    to eager's gradients."""
    x = torch.randn(4, 8)
    forward = dcir.compile_to_ir(_Attention(), (x,)).functions["forward"]
    assert not [op for op in forward.ops if op.name == "aten.clone.default"], str(forward)
    exposed = dcir.compile_to_ir(_Attention(expose=True), (x,)).functions["forward"]  # both outputs
    assert [op for op in exposed.ops if op.name == "aten.clone.default"], str(exposed)
    torch.manual_seed(0)
    model = _Attention()
    mine = copy.deepcopy(model)
    expected = torch.autograd.grad(model(x), [model.proj.weight, model.proj.bias])
    dcir.lower(dcir.compile_to_ir(model, (x,)), state_of(mine)).train_step(x)
    torch.testing.assert_close([mine.proj.weight.grad, mine.proj.bias.grad], list(expected), rtol=0, atol=0)


def _backend_forward(model, x, monkeypatch):
    """The forward module ``torch.compile(model, backend="dcir")`` lowered, and the step's
    loss and gradients."""
    seen = {}
    original = dcir_dynamo.graph_to_module

    def recorded(gm, name):
        module, none_at = original(gm, name)
        seen.setdefault(name, module)
        return module, none_at
    monkeypatch.setattr(dcir_dynamo, "graph_to_module", recorded)
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend="dcir")(x)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
    finally:
        torch._dynamo.reset()
    return seen["forward"].functions["forward"], [model.proj.weight.grad, model.proj.bias.grad]


def test_the_backend_folds_a_copy_that_copies_nothing_too(monkeypatch):
    """Through ``torch.compile(backend="dcir")`` as through the Engine's capture: the
    dropout's clone is gone, a copy the model returns stays, the gradients are eager's."""
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    model = _Attention()
    mine = copy.deepcopy(model)
    expected = torch.autograd.grad(model(x), [model.proj.weight, model.proj.bias])
    forward, grads = _backend_forward(mine, x, monkeypatch)
    assert not [op for op in forward.ops if op.name == "aten.clone.default"], str(forward)
    torch.testing.assert_close(grads, list(expected), rtol=0, atol=0)
    exposed, _ = _backend_forward(_Attention(expose=True), x, monkeypatch)
    assert [op for op in exposed.ops if op.name == "aten.clone.default"], str(exposed)
