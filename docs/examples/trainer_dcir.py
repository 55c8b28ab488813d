"""A transformers Trainer script, sharded through DCIR by one argument (docs/integrations.md).

    torchrun --nproc-per-node 2 docs/examples/trainer_dcir.py --out run        # DcirTrainer
    torchrun --nproc-per-node 2 docs/examples/trainer_dcir.py --out ddp --stock  # the same under DDP

A Llama built from a config trains on sequences of a fixed corpus for 30 optimizer
steps: 2 sequences per rank and micro-step, 2 micro-steps per step, AdamW with weight
decay, warmup then a cosine schedule, gradients clipped to norm 1, a checkpoint every 5
steps, an evaluation on 16 held-out sequences every 10. ``--resume`` continues from the
newest complete checkpoint in ``--out`` (a job stopped by SIGKILL, restarted). At the
end the model is saved in ``--out/final`` (``from_pretrained`` loads it), rank 0
writes the logged training and evaluation losses to ``--out/log.json``, and each rank
leaves without finalizing the interpreter (the end of the file says why).
"""

import argparse
import json
import os
import signal
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dcir_runtime.hf import DcirTrainer


class Corpus(torch.utils.data.Dataset):
    """``size`` sequences of 32 tokens, the same on every run: each an arithmetic
    progression modulo 512 from a start and stride drawn from its own seed (learnable:
    each token follows from the two before it); ``first`` is the first seed."""

    def __init__(self, size: int = 240, first: int = 0):
        self.size, self.first = size, first

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        start, stride = torch.randint(0, 512, (2,), generator=torch.Generator().manual_seed(self.first + i))
        ids = (start + stride * torch.arange(32)) % 512
        return {"input_ids": ids, "labels": ids.clone()}


class KillAt(TrainerCallback):
    """``--kill-at N``: rank 1 SIGKILLs itself at the end of step N, once (a marker file
    in ``--out`` remembers), as a preempted job dies."""

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, marker

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and int(os.environ.get("RANK", 0)) == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the Trainer's output_dir")
    ap.add_argument("--stock", action="store_true", help="the stock Trainer (DDP) instead of DcirTrainer")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out, if any")
    ap.add_argument("--kill-at", type=int, default=0, help="rank 1 SIGKILLs itself after this step, once")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TrainingArguments(bf16=True))")
    ap.add_argument("--fsdp", action="store_true", help="with --stock: the stock Trainer's FSDP instead of DDP")
    ns = ap.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    args = TrainingArguments(
        output_dir=ns.out, max_steps=30, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=3e-3, weight_decay=0.1, warmup_steps=5, lr_scheduler_type="cosine", max_grad_norm=1.0,
        logging_steps=1, save_steps=5, eval_strategy="steps", eval_steps=10, report_to=[], disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available(),  # on CPU, accelerate joins the ranks over gloo only with use_cpu
        bf16=ns.bf16, **({"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
                         if ns.fsdp else {}))
    trainer_class = Trainer if ns.stock else DcirTrainer  # the one line that differs from a DDP script
    trainer = trainer_class(model=model, args=args, train_dataset=Corpus(), eval_dataset=Corpus(16, first=10_000),
                            callbacks=[KillAt(ns.kill_at, os.path.join(ns.out, "killed"))] if ns.kill_at else None)
    resume = ns.resume and os.path.isdir(ns.out) and get_last_checkpoint(ns.out) is not None
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model(os.path.join(ns.out, "final"))
    if args.process_index == 0:
        logged = {key: [(e["step"], e[key]) for e in trainer.state.log_history if key in e]
                  for key in ("loss", "eval_loss")}
        with open(os.path.join(ns.out, "log.json"), "w") as f:
            json.dump(logged, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Under the Trainer the gloo group can outlive destroy_process_group: DDP holds it, and so does
    # DeepSpeed where it is installed (the Trainer's stack imports it once the group exists, and its
    # comm module's barrier keeps the group as a default argument). A worker thread of the group can then
    # still be dropping the last collective's work while the interpreter finalizes. That work holds
    # a Python object, Python ends the thread as it takes the GIL, and the rank aborts ("terminate
    # called without an active exception", SIGABRT): 10 of 63 runs of a two-rank DDP script here,
    # twice in CI after the final save. Every file is written and closed by now, so the rank leaves
    # as it is.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
