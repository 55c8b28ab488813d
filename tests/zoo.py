"""The model zoo: Hugging Face ``transformers`` models built from configs at tiny sizes.

Real users bring models they did not write, so the zoo is chosen for breadth, not for
what DCIR already runs: decoder-only language models with tied and untied embeddings,
encoder-only masked LMs, encoder-decoder seq2seq models with labels, mixture-of-experts
decoders, a vision transformer, a CNN with BatchNorm, a model with dropout, and a model
with a frozen part and a module used twice (ALBERT shares one layer across its depth).

Every model is built from a config (no download): hidden 32-64, 2 layers, sequences of
8, vocabularies of at most 256, weights from a seeded init, dropout 0 unless the entry
is about dropout (compared under the same generator states: ``eager_reference``),
attention ``eager`` (the same kernels in every run). Everything else
is the config's default, as a user gets it: decoders build their KV cache in forward
(``use_cache=True``) even while training. A batch is
``(inputs, y)``: the keyword inputs of ``model(**inputs)`` and the target ``y`` that
``model(**inputs, labels=y)`` takes, or that a user's criterion compares the logits with.

``tests/test_zoo.py`` trains each model three ways and compares each with single-device
eager; ``tests/zoo_worker.py`` is one rank of its world-2 runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import dcir

VOCAB = 128
SEQ = 8
HIDDEN = 32
LAYERS = 2
IMAGE = 16
CLASSES = 4


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build it, what a batch of it is, and what it covers."""

    name: str
    covers: str                                   # the breadth it stands for, in the coverage table
    make: Callable[[], torch.nn.Module]           # seeded by the caller
    batch: Callable[[torch.Generator, int], tuple[dict, torch.Tensor]]
    #: compared with eager after 3 steps; False: the run only has to train
    matches: bool = True
    #: draws random numbers while training (dropout at p > 0): compared under the same
    #: generator states (random ops run eagerly, also between compiled stretches)
    random: bool = False

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.make().train()


def criterion(out, y: torch.Tensor) -> torch.Tensor:
    """The user's loss computed outside the model: cross-entropy of the logits against
    ``y`` (every position; -100 is ignored, as Hugging Face's masked-LM labels mark)."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def aux_term(out) -> torch.Tensor:
    """An auxiliary loss: the router's load-balancing loss of a mixture of experts, else a
    small penalty on the logits (what z-loss regularizers look like)."""
    aux = getattr(out, "aux_loss", None)
    return aux if aux is not None else out.logits.float().pow(2).mean()


# ---- batches ---------------------------------------------------------------------------


def _tokens(g: torch.Generator, rows: int) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return {"input_ids": ids}, ids.clone()


def _masked(g: torch.Generator, rows: int) -> tuple[dict, torch.Tensor]:
    """Masked-LM: a quarter of the positions are predicted (token 3 stands for [MASK]);
    the others are -100 in the labels, as Hugging Face's data collator writes them."""
    ids = torch.randint(4, VOCAB, (rows, SEQ), generator=g)
    chosen = torch.rand(rows, SEQ, generator=g) < 0.25
    chosen[:, 0] = True  # at least one position per row
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(chosen, torch.full_like(ids, 3), ids)}, labels


def _seq2seq(shift: Callable[[torch.Tensor], torch.Tensor]):
    def batch(g: torch.Generator, rows: int) -> tuple[dict, torch.Tensor]:
        ids = torch.randint(2, VOCAB, (rows, SEQ), generator=g)
        labels = torch.randint(2, VOCAB, (rows, SEQ), generator=g)
        return {"input_ids": ids, "decoder_input_ids": shift(labels)}, labels
    return batch


def _shift_right(labels: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The decoder's inputs: the labels shifted right behind the start token (T5 and BART
    both start with token 0 here; their configs say so below)."""
    return torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)


def _images(g: torch.Generator, rows: int) -> tuple[dict, torch.Tensor]:
    return {"pixel_values": torch.randn(rows, 3, IMAGE, IMAGE, generator=g)}, torch.randint(
        0, CLASSES, (rows,), generator=g)


# ---- models ----------------------------------------------------------------------------

_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN * 2, intermediate_size=HIDDEN * 4, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                attn_implementation="eager")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_DECODER, tie_word_embeddings=False))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**_DECODER, tie_word_embeddings=True))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_DECODER, sliding_window=4, tie_word_embeddings=False))


def _gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(**_DECODER, head_dim=16, tie_word_embeddings=True))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**_DECODER, pad_token_id=0, tie_word_embeddings=False))


def _gpt2(dropout: float = 0.0):
    def make():
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN * 2, n_layer=LAYERS,
                                          n_head=4, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                          attn_implementation="eager"))
    return make


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN * 2, intermediate_size=HIDDEN * 4,
                                            num_hidden_layers=LAYERS, num_attention_heads=4,
                                            max_position_embeddings=64, attn_implementation="eager",
                                            tie_word_embeddings=False))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN * 2, ffn_dim=HIDDEN * 4,
                                    num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=64,
                                    word_embed_proj_dim=HIDDEN * 2, dropout=0.0, attention_dropout=0.0,
                                    attn_implementation="eager", pad_token_id=1))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=True, tie_word_embeddings=False))


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**_DECODER, moe_intermediate_size=HIDDEN,
                                              shared_expert_intermediate_size=HIDDEN * 2, num_experts=4,
                                              num_experts_per_tok=2, output_router_logits=True,
                                              tie_word_embeddings=False))


_ENCODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN * 2, num_hidden_layers=LAYERS, num_attention_heads=4,
                intermediate_size=HIDDEN * 4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, attn_implementation="eager")


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(**_ENCODER))


def _roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM
    return RobertaForMaskedLM(RobertaConfig(**_ENCODER, pad_token_id=1))


def _albert_frozen():
    """ALBERT runs its one shared layer at every depth (a module used twice), here with
    the embeddings frozen (a frozen part), as in fine-tuning on top of a fixed embedding."""
    from transformers import AlbertConfig, AlbertForMaskedLM
    model = AlbertForMaskedLM(AlbertConfig(**_ENCODER, embedding_size=HIDDEN, num_hidden_groups=1))
    for p in model.albert.embeddings.parameters():
        p.requires_grad_(False)
    return model


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=HIDDEN * 2, d_kv=16, d_ff=HIDDEN * 4,
                                               num_layers=LAYERS, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0,
                                               attn_implementation="eager"))


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN * 2, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=HIDDEN * 4,
        decoder_ffn_dim=HIDDEN * 4, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, decoder_start_token_id=0, pad_token_id=1, attn_implementation="eager"))


def _vit():
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=HIDDEN * 2, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=HIDDEN * 4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=CLASSES, attn_implementation="eager"))


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=CLASSES))


ZOO: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("llama", "decoder LM, untied embeddings (RoPE, RMSNorm, GQA)", _llama, _tokens),
    ZooModel("gpt2", "decoder LM, tied embeddings (Conv1D, learned positions)", _gpt2(), _tokens),
    ZooModel("qwen2", "decoder LM, tied embeddings, q/k/v biases", _qwen2, _tokens),
    ZooModel("mistral", "decoder LM, untied, sliding-window mask", _mistral, _tokens),
    ZooModel("gemma", "decoder LM, tied, scaled embeddings", _gemma, _tokens),
    ZooModel("phi3", "decoder LM, untied, fused qkv and gate/up", _phi3, _tokens),
    ZooModel("gpt_neox", "decoder LM, untied, parallel residual, partial RoPE", _gpt_neox, _tokens),
    ZooModel("opt", "decoder LM, tied, learned offset positions", _opt, _tokens),
    ZooModel("mixtral", "mixture of experts (top-2 of 4), router aux loss", _mixtral, _tokens),
    ZooModel("qwen2_moe", "mixture of experts with a shared expert", _qwen2_moe, _tokens),
    ZooModel("bert", "encoder-only masked LM, tied decoder", _bert, _masked),
    ZooModel("roberta", "encoder-only masked LM, padding-offset positions", _roberta, _masked),
    ZooModel("albert_frozen", "a module used twice (shared layer) and a frozen part (embeddings)",
             _albert_frozen, _masked),
    ZooModel("t5", "encoder-decoder seq2seq with labels, relative position bias", _t5, _seq2seq(_shift_right)),
    ZooModel("bart", "encoder-decoder seq2seq with labels, tied", _bart, _seq2seq(_shift_right)),
    ZooModel("vit", "vision transformer (patch conv, CLS token)", _vit, _images),
    ZooModel("resnet", "CNN with BatchNorm (running statistics compared)", _resnet, _images),
    ZooModel("gpt2_dropout", "dropout p=0.1 in training, compared under the same seed; tied embeddings", _gpt2(0.1),
             _tokens, random=True),
]}


# ---- training, as a user's loop writes it ----------------------------------------------

STEPS = 3
ROWS = 2       # per rank and micro-step
LR = 1e-3
TOLERANCE = 1e-5


def _labels(model, inputs, y):
    return model(**inputs, labels=y).loss


def _criterion(model, inputs, y):
    return criterion(model(**inputs), y)


def _aux(model, inputs, y):
    out = model(**inputs, labels=y)
    return out.loss + 0.01 * aux_term(out)


def _accumulate(model, inputs, y):
    return criterion(model(**inputs), y) / 2


#: loss form -> (loss(model, inputs, y), micro-steps per optimizer step). ``labels``: the
#: model's own loss (what the Engine runs today); the others compute it outside the
#: model, the way the issue's loops do: ``criterion(out.logits, y)``, ``out.loss + 0.01 *
#: aux``, and ``loss / accumulation`` with accumulation 2.
FORMS = {"labels": (_labels, 1), "criterion": (_criterion, 1), "aux": (_aux, 1), "accumulate": (_accumulate, 2)}


def micro_batches(z: ZooModel, world: int, accumulate: int):
    """The global micro-batches of ``STEPS`` optimizer steps, seeded: ``ROWS`` rows per rank."""
    for k in range(STEPS * accumulate):
        yield z.batch(torch.Generator().manual_seed(1000 + k), ROWS * world)


def rank_slice(batch, rank: int):
    inputs, y = batch
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    return {k: v[rows] for k, v in inputs.items()}, y[rows]


def eager_reference(z: ZooModel, form: str, world: int) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """Single-device eager training of ``form``: each micro-step, every rank's part of the
    batch in rank order, the gradients summed in that order and divided by the ranks (as
    the runtime's reduction rounds, so the comparison can be bit for bit), AdamW at the
    accumulation boundary. Each rank draws its dropout masks from its own generator,
    seeded with the model (``ZooModel.model``), so each rank's part runs from that rank's
    generator state: the masks are the ones the ranks drew. Likewise each rank's part runs
    on that rank's own buffers (BatchNorm's running statistics), which each Engine rank
    updates from its own part alone. Gradients come from ``loss.backward()``, which
    reentrant activation checkpointing needs (it refuses ``torch.autograd.grad``).
    Returns the model and each rank's buffers."""
    loss_of, accumulate = FORMS[form]
    model = z.model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    generators = [torch.get_rng_state() for _ in range(world)]  # rank -> its generator's state
    buffers = dict(model.named_buffers())
    ranks = [{n: b.clone() for n, b in buffers.items()} for _ in range(world)]  # rank -> its buffers
    summed = None  # the gradients of the optimizer step so far
    for k, batch in enumerate(micro_batches(z, world, accumulate)):
        total = None
        for r in range(world):
            torch.set_rng_state(generators[r])
            with torch.no_grad():
                for n, b in buffers.items():
                    b.copy_(ranks[r][n])
            opt.zero_grad(set_to_none=True)
            loss_of(model, *rank_slice(batch, r)).backward()
            generators[r] = torch.get_rng_state()
            ranks[r] = {n: b.clone() for n, b in buffers.items()}
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        total = [g / world if world > 1 else g for g in total]
        summed = total if summed is None else [s + g for s, g in zip(summed, total)]
        if (k + 1) % accumulate == 0:
            for p, g in zip(params, summed):
                p.grad = g
            summed = None
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, ranks


def from_one_state(*steps):
    """What each of ``steps`` (functions of nothing) returns, each run from the generator
    state the first starts from: dropout draws the same masks in every one."""
    start = torch.get_rng_state()
    out = []
    for step in steps:
        torch.set_rng_state(start)
        out.append(step())
    return out


def _eager_loss(model, kwargs) -> torch.Tensor:
    """``model``'s own loss on ``kwargs``, backpropagated."""
    loss = model(**kwargs).loss
    loss.backward()
    return loss


def captured_step(z: ZooModel):
    """Two copies of ``z``'s model (eager's, and one the lowered program trains), a batch
    of two rows with its labels, and the step captured with the model's own loss."""
    ref = z.model()
    mine = copy.deepcopy(ref)
    inputs, y = z.batch(torch.Generator().manual_seed(1), 2)
    kwargs = {**inputs, "labels": y}
    return ref, mine, kwargs, dcir.compile_to_ir(ref, (), kwargs=kwargs, loss_fn=lambda out: out.loss)


def eager_and_lowered(ref, program, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one eager step of ``ref`` and of one step of the lowered ``program``,
    from one generator state (gradients left on the parameters)."""
    return tuple(from_one_state(lambda: _eager_loss(ref, kwargs), lambda: program.train_step(**kwargs)))


def worst_relative(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference over the tensors of ``reference`` (floating point), each
    relative to that tensor's largest magnitude, and the tensor's name."""
    worst, where = 0.0, ""
    for name, a in reference.items():
        if not a.dtype.is_floating_point:
            if not torch.equal(a, got[name]):
                return float("inf"), name
            continue
        b = got[name].to(a.dtype)
        err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12)
        if not err <= worst:  # NaN counts as the worst
            worst, where = err, name
    return worst, where
