"""torch.compile(model, backend="dcir") trains through DCIR and matches eager."""

from __future__ import annotations

import copy

import torch

import dcir_lowering.dynamo as dynamo
from models import ConvBN


def test_backend_is_registered():
    assert "dcir" in torch._dynamo.list_backends()


def test_training_through_the_backend_matches_eager(monkeypatch):
    seen = []
    original = dynamo.graph_to_module
    monkeypatch.setattr(dynamo, "graph_to_module", lambda gm, name: seen.append(name) or original(gm, name))
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = ConvBN()
    mine = copy.deepcopy(ref)
    step = torch.compile(mine, backend="dcir")
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    for _ in range(3):
        opt_ref.zero_grad()
        loss_ref = ref(x, y)
        loss_ref.backward()
        opt_ref.step()
        opt_mine.zero_grad()
        loss_mine = step(x, y)
        loss_mine.backward()
        opt_mine.step()
        assert abs(loss_ref.item() - loss_mine.item()) <= 1e-6 * abs(loss_ref.item())
    assert seen == ["forward", "backward"]  # both graphs went through DCIR, once
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-7), name
    torch._dynamo.reset()
