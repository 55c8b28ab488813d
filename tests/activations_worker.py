"""One rank of the activation-checkpointing runs at world 2 (started by ``dcir_runtime.launch``).

``python activations_worker.py OUT.json CASE...``: each case of ``CASES`` (a model that
checkpoints its activations itself) trains through the Engine (ZeRO-3) for 3 AdamW
steps with the loss computed outside, exactly as ``zoo_worker.train`` trains a zoo
model; rank 0 trains it eagerly on one device with the same checkpointing
(``zoo.eager_reference``: each rank's part from that rank's generator, so dropout draws
the same masks) and writes, per case, the worst relative parameter difference and how
many ops of the program are marked recompute.
"""

from __future__ import annotations

import os
import sys

from models import Checkpointed, checkpointed_llama
from zoo import ZOO, ZooModel
from zoo_worker import finish, train

_tokens = ZOO["llama"].batch

#: name -> a model that checkpoints its own activations, each with dropout inside the
#: checkpointed region (``random``: compared under the same generator states)
CASES = {z.name: z for z in [
    ZooModel("llama_checkpointing", "gradient_checkpointing_enable(), non-reentrant",
             lambda: checkpointed_llama(reentrant=False), _tokens, random=True),
    ZooModel("llama_checkpointing_reentrant", "gradient_checkpointing_enable(use_reentrant=True)",
             lambda: checkpointed_llama(reentrant=True), _tokens, random=True),
    ZooModel("checkpoint_in_model", "torch.utils.checkpoint.checkpoint in the model's forward",
             Checkpointed, _tokens, random=True),
    ZooModel("selective_checkpointing", "create_selective_checkpoint_contexts: matmuls saved",
             lambda: Checkpointed(selective=True), _tokens, random=True),
]}


def main() -> int:
    out_path, names = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    return finish({name: train(CASES[name], "criterion", rank) for name in names}, out_path, rank)


if __name__ == "__main__":
    sys.exit(main())
