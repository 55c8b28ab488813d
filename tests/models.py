"""The reference models the tests train, capture and compare, in one plain module.

Test files, and the workers that ``dcir_runtime.launch`` starts as scripts from this
folder, import them as ``from models import ...``: pytest puts ``tests/`` on the path,
and Python puts a script's own folder there.
"""

from __future__ import annotations

import collections
import functools

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


@torch._dynamo.disable
def _eager_only(h):
    """A call Dynamo does not trace (as a C extension or an unsupported library would be):
    the graph breaks around it, and it runs eagerly, under autograd."""
    return h * torch.sigmoid(h)


class BreakingNet(torch.nn.Module):
    """Three layers with a graph break between each (``how``): ``item`` branches on a
    value read with ``.item()`` (data-dependent: each rank may go its own way, with the
    same collectives); ``call`` calls a function Dynamo cannot trace; ``print`` prints a
    tensor's value; ``inline`` computes what ``call`` does, without a break. ``extra``: the ``item`` branch uses a layer of its own, so ranks that
    branch differently run different collectives."""

    def __init__(self, how: str = "item", extra: bool = False):
        super().__init__()
        self.how = how
        self.fc1, self.fc2, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 16) if extra else None

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.how == "item":
            if h.mean().item() > 0.25:
                h = self.extra(h) if self.extra is not None else h * 2
        elif self.how == "call":
            h = _eager_only(h)
        elif self.how == "inline":  # what "call" computes, traced: no break
            h = h * torch.sigmoid(h)
        else:
            print("dcir-test: largest activation", h.abs().max())
        h = torch.tanh(self.fc2(h))
        return self.head(h)


class _EagerLayer(torch.nn.Linear):
    """A layer Dynamo does not trace: its call runs eagerly, with its own parameters."""

    @torch._dynamo.disable
    def forward(self, x):
        return super().forward(x)


class EagerLayerNet(torch.nn.Module):
    """An MLP whose middle layer runs outside every graph (``_EagerLayer``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.mid, self.head = torch.nn.Linear(8, 16), _EagerLayer(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.relu(self.fc1(x)))))


class InPlaceNet(torch.nn.Module):
    """The graph after a ``.item()`` branch doubles its input in place, which DCIR does
    not capture: that graph runs eagerly, ``fc2`` gathered for it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        if h.mean().item() > 10:
            h = h + 1
        h.mul_(2)
        return self.fc2(torch.tanh(h))


def checkpointed_llama(reentrant: bool):
    """``tiny_llama`` with attention dropout, and the first switch of every fine-tuning
    recipe: ``gradient_checkpointing_enable()`` (each decoder layer recomputed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager", attention_dropout=0.1)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


class _Block(torch.nn.Module):
    """A residual MLP block with dropout inside."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, h):
        return h + torch.nn.functional.dropout(self.down(torch.nn.functional.gelu(self.up(self.norm(h)))), 0.1,
                                               self.training)


#: what ``Checkpointed`` returns: its logits, by name
LMOutput = collections.namedtuple("LMOutput", "logits")


class Checkpointed(torch.nn.Module):
    """Blocks run under ``torch.utils.checkpoint.checkpoint`` in the model's own code, with
    dropout inside the checkpointed region; with ``selective``, torch's selective
    checkpointing (``create_selective_checkpoint_contexts``): matmuls saved, the rest
    recomputed."""

    def __init__(self, selective: bool = False, width: int = 16, blocks: int = 2, vocab: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, vocab)
        self.selective = selective

    def forward(self, input_ids):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        h = self.embed(input_ids)
        for block in self.blocks:
            if self.selective:
                context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                h = checkpoint(block, h, use_reentrant=False, context_fn=context)
            else:
                h = checkpoint(block, h, use_reentrant=False)
        return LMOutput(self.head(h))


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: keep what the matmuls made, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE
