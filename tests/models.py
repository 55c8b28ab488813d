"""The reference models the tests train, capture and compare, in one plain module.

Test files, and the workers that ``dcir_runtime.launch`` starts as scripts from this
folder, import them as ``from models import ...``: pytest puts ``tests/`` on the path,
and Python puts a script's own folder there.
"""

from __future__ import annotations

import torch


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def squared(out):
    """The loss ``mlp`` trains with: its output has no loss of its own."""
    return out.pow(2).mean()


def tiny_llama():
    """A 2-layer transformers Llama (grouped-query attention, eager attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before BatchNorm: it would have an exactly-zero gradient, which AdamW
        # turns from rounding noise into a visible update
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 2)
        self.bn.weight.requires_grad_(False)  # a frozen parameter

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return torch.nn.functional.cross_entropy(self.fc(h), y)


class Tied(torch.nn.Module):
    """Tied input and output embeddings, and a frozen layer between them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.mix.weight.requires_grad_(False)  # frozen

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids)))).logsumexp(-1).mean()


class Breaks(torch.nn.Module):
    """Data-dependent control flow: Dynamo breaks the graph at the ``if``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow: a graph break
            y = y * 2
        return y.mean()
