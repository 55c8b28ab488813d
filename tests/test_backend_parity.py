"""``torch.compile(model, backend="dcir")`` works wherever ``backend="aot_eager"`` does,
and matches it; where it cannot, it raises a clear DCIR error that names the construct
and the user's line, never an internal assertion.

Both backends run the same AOTAutograd graphs; ``aot_eager`` runs them as they are, DCIR
as FX -> a verified DCIR function -> FX, so on fp32 they agree bit for bit (the tests
allow 1e-6 relative). Each model trains 2 AdamW steps from the same seed with the loss
computed outside the compiled model (``criterion(out.logits, y)``), and runs once more
as ``model.eval()`` under ``torch.no_grad()``. The zoo's decoders build a KV cache in
forward (``use_cache=True``, their default, also in training); t5 and bart are the
encoder-decoders. By default a representative subset runs (``DEFAULT``); the whole zoo
is ``slow`` (``pytest -m slow tests/test_backend_parity.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import dcir
import dcir_lowering.dynamo as dcir_dynamo
from models import Breaks, ConvBN, Tied, mlp, squared, tiny_llama
from zoo import LR, ZOO, criterion, worst_relative

DEFAULT = ("llama", "t5", "resnet")  # a KV-cache decoder, an encoder-decoder, BatchNorm
TOLERANCE = 1e-6


def _zoo_cases():
    for name in ZOO:
        yield pytest.param(name, marks=[] if name in DEFAULT else [pytest.mark.slow], id=name)


def _state(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _train(model, backend: str, batches, loss_of, **options) -> list[float]:
    """AdamW steps of ``torch.compile(model, backend=...)`` on ``batches``; the losses."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, **options)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    try:
        for batch in batches:
            loss = loss_of(compiled, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        torch._dynamo.reset()
    return losses


def _same_training(make, batches, loss_of, **options) -> None:
    """``make()`` trained through aot_eager and through dcir: same losses, same state."""
    torch.manual_seed(0)
    ref = make()
    mine = copy.deepcopy(ref)
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    expected = _train(ref, "aot_eager", batches, loss_of, **options)
    torch.manual_seed(1)
    got = _train(mine, "dcir", batches, loss_of, **options)
    assert got == pytest.approx(expected, rel=TOLERANCE)
    worst, where = worst_relative(_state(ref), _state(mine))
    assert worst <= TOLERANCE, f"{where}: {worst:.2e} relative to aot_eager"


def _zoo_batches(name: str, rows: int = 2, steps: int = 2) -> list:
    return [ZOO[name].batch(torch.Generator().manual_seed(1000 + k), rows) for k in range(steps)]


def _outside(compiled, inputs, y):
    return criterion(compiled(**inputs), y)


@pytest.mark.parametrize("name", list(_zoo_cases()))
def test_zoo_model_trains_through_dcir_like_aot_eager(name):
    _same_training(ZOO[name].model, _zoo_batches(name), _outside)


@pytest.mark.parametrize("name", list(_zoo_cases()))
def test_zoo_model_infers_through_dcir_like_aot_eager(name):
    """``model.eval()`` and ``torch.no_grad()``: AOTAutograd's inference graph, through DCIR;
    a decoder's KV cache comes back too, every key and value tensor equal to aot_eager's."""
    inputs, _ = ZOO[name].batch(torch.Generator().manual_seed(7), 2)
    outs = []
    for backend in ("aot_eager", "dcir"):
        model = ZOO[name].model().eval()
        torch._dynamo.reset()
        with torch.no_grad():
            outs.append(torch.compile(model, backend=backend)(**inputs))
        torch._dynamo.reset()
    expected, got = outs
    assert torch.equal(expected.logits, got.logits)
    if getattr(expected, "past_key_values", None) is not None:
        want, have = _cache_tensors(expected.past_key_values), _cache_tensors(got.past_key_values)
        assert want and len(have) == len(want)
        for k, (a, b) in enumerate(zip(want, have)):
            assert torch.equal(a, b), f"KV cache tensor {k} of {len(want)}"


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every key and value tensor of a ``transformers`` cache, layer by layer; an
    encoder-decoder's self-attention cache, then its cross-attention cache."""
    if hasattr(cache, "self_attention_cache"):
        return _cache_tensors(cache.self_attention_cache) + _cache_tensors(cache.cross_attention_cache)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


# ---- the reference models of tests/models.py ----------------------------------------------


def _xy(compiled, x, y):
    return compiled(x, y)


def _squared(compiled, x):
    return squared(compiled(x))


def _scalar(compiled, x):
    return compiled(x)


def _llama_outside(compiled, ids):
    logits = compiled(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


_MODELS = {
    "mlp": (mlp, _squared, lambda g: (torch.randn(4, 8, generator=g),)),
    "convbn": (ConvBN, _xy, lambda g: (torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 2, (2,), generator=g))),
    "tied": (Tied, _scalar, lambda g: (torch.randint(0, 10, (2, 5), generator=g),)),
    "breaks": (Breaks, _scalar, lambda g: (torch.randn(2, 4, generator=g),)),  # a real break: two graphs
    "tiny_llama": (tiny_llama, _llama_outside, lambda g: (torch.randint(0, 128, (2, 8), generator=g),)),
}


@pytest.mark.parametrize("name", list(_MODELS))
def test_reference_model_trains_through_dcir_like_aot_eager(name):
    make, loss_of, batch = _MODELS[name]
    _same_training(make, [batch(torch.Generator().manual_seed(k)) for k in range(2)], loss_of)


# ---- where dcir cannot, a clear error -------------------------------------------------------


def _dcir_error(excinfo) -> str:
    """The DcirError behind Dynamo's BackendCompilerFailed, rendered."""
    cause = excinfo.value.__cause__ or getattr(excinfo.value, "inner_exception", None)
    assert isinstance(cause, dcir.DcirError), repr(cause)
    return cause.render()


def test_a_changed_batch_size_trains_with_static_shapes():
    """A batch of another size: Dynamo recompiles; with ``dynamic=False`` each shape is its own
    static graph, which DCIR takes, and the run matches aot_eager."""
    batches = _zoo_batches("gpt2", rows=2) + _zoo_batches("gpt2", rows=3, steps=1)
    _same_training(ZOO["gpt2"].model, batches, _outside, dynamic=False)


# (batch rows, sequence length) of each step: the batch shrinks, grows, and the sequence changes
_SHAPES = ((4, 8), (2, 8), (3, 5), (2, 6), (3, 5))


def _zoo_llama_batches() -> list:
    batches = []
    for k, (rows, seq) in enumerate(_SHAPES):
        inputs, y = ZOO["llama"].batch(torch.Generator().manual_seed(2000 + k), rows)
        batches.append(({"input_ids": inputs["input_ids"][:, :seq]}, y[:, :seq]))
    return batches


_CHANGING = {
    "mlp": (mlp, _squared, [(torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)),)
                            for rows, _ in _SHAPES]),
    "tiny_llama": (tiny_llama, _llama_outside, [(torch.randint(0, 128, (rows, seq), generator=torch.Generator()
                                                               .manual_seed(rows * seq)),) for rows, seq in _SHAPES]),
    "zoo_llama": (ZOO["llama"].model, _outside, _zoo_llama_batches()),
}


@pytest.fixture
def per_shape(monkeypatch):
    """Every ``PerShape`` the dcir backend makes (a graph whose sizes Dynamo made symbolic)."""
    made = []
    init = dcir_dynamo.PerShape.__init__

    def spy(self, *args):
        init(self, *args)
        made.append(self)
    monkeypatch.setattr(dcir_dynamo.PerShape, "__init__", spy)
    return made


#: the default tier trains each model under one of Dynamo's modes (the zoo's Llama with every
#: size symbolic from the first call, the tiny one under automatic dynamic); the slow tier the others
_SLOW_PARITY = {("zoo_llama", "automatic"), ("tiny_llama", "dynamic")}


@pytest.mark.parametrize("name,dynamic", [
    pytest.param(name, dynamic, id=f"{name}-{mode}", marks=[pytest.mark.slow] if (name, mode) in _SLOW_PARITY else [])
    for name in _CHANGING for dynamic, mode in ((None, "automatic"), (True, "dynamic"))])
def test_changing_shapes_train_through_dcir_like_aot_eager(name, dynamic, per_shape):
    """Batches of 4, 2, 3 rows and sequences of 8, 5, 6: with the default ``dynamic=None``
    Dynamo makes the changed sizes symbolic ("automatic dynamic"), with ``dynamic=True``
    all of them from the first call. DCIR compiles one static program per concrete shape
    (forward and backward through DCIR) and trains like aot_eager."""
    make, loss_of, batches = _CHANGING[name]
    _same_training(make, batches, loss_of, dynamic=dynamic)
    assert per_shape, "no graph with symbolic sizes reached the backend"
    assert all(p.compiles == len(p.programs) for p in per_shape)  # a shape seen again is not recompiled
    assert max(p.compiles for p in per_shape) >= 2


@pytest.mark.parametrize("dynamic", [None, pytest.param(True, marks=pytest.mark.slow)], ids=["automatic", "dynamic"])
def test_changing_shapes_infer_through_dcir_like_aot_eager(dynamic, per_shape):
    """``model.eval()`` under ``torch.no_grad()``: AOTAutograd's inference graph, one per shape."""
    ids = [torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(k))
           for k, (rows, seq) in enumerate(_SHAPES)]
    outs = []
    for backend in ("aot_eager", "dcir"):
        torch.manual_seed(0)
        model = tiny_llama().eval()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        with torch.no_grad():
            outs.append([compiled(input_ids=i).logits for i in ids])
        torch._dynamo.reset()
    expected, got = outs
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert per_shape and max(p.compiles for p in per_shape) >= 2


def test_shapes_beyond_the_recompile_limit_replace_the_least_recently_used_program(per_shape):
    """At most ``torch._dynamo.config.recompile_limit`` programs per graph; a new shape
    beyond them drops the least recently used one (a warning, once), and the results stay
    those of eager."""
    torch.manual_seed(0)
    model = mlp()
    xs = [torch.randn(rows, 8) for rows in (2, 3, 4, 3, 2, 5)]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled = torch.compile(model, backend="dcir", dynamic=True)
        with pytest.warns(UserWarning, match="DCIR: a graph met more than 2 input shapes") as warned:
            outs = [compiled(x) for x in xs]
    torch._dynamo.reset()
    assert len([w for w in warned if "DCIR:" in str(w.message)]) == 1
    (graph,) = per_shape
    # 2, 3; 4 drops 2; 3 is kept; 2 drops 4; 5 drops 3
    assert graph.compiles == 5
    assert [[e for e in k if isinstance(e, int)] for k in graph.programs] == [[2], [5]]  # the batch size
    for x, out in zip(xs, outs):
        assert torch.equal(out, model(x))


class Cond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t * 3, (h,))


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_a_higher_order_op_is_an_error_at_the_users_line(dynamic):
    """``torch.cond`` reached the lowering as a subgraph read as a constant tensor
    ("AttributeError: 'GraphModule' object has no attribute 'numel'"); with symbolic
    sizes too, the error comes when Dynamo compiles, not at the first call."""
    x = torch.randn(2, 4)
    _train(Cond(), "aot_eager", [(x,)], lambda c, x: c(x).pow(2).mean(), dynamic=dynamic)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as e:
        _train(Cond(), "dcir", [(x,)], lambda c, x: c(x).pow(2).mean(), dynamic=dynamic)
    message = _dcir_error(e)
    assert "cannot lower to DCIR: torch.cond is a higher-order op (it calls subgraphs), which DCIR cannot express" \
        in message
    assert f"(at {__file__}:" in message
    assert "rewrite it with torch.where" in message
