"""Starting without the full model (docs/runtime.md, "Starting without the full model"):
a model built on the meta device initialized shard by shard (every rank, or streamed
from rank 0) trains bit for bit like the same init on one device; a pretrained
safetensors checkpoint loads into the shards and gives ``from_pretrained``'s logits and
loss; what cannot start is an error that names the tensors or keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcir_runtime.launch import launch

WORKER = str(Path(__file__).resolve().parent / "start_worker.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from models import tiny_llama

    path = tmp_path_factory.mktemp("pretrained") / "llama"
    torch.manual_seed(5)
    tiny_llama().save_pretrained(path, max_shard_size="100KB")  # sharded, with an index
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.mark.parametrize("case,world", [("transformer_init_fn", 2), ("llama", 3), ("llama_stream", 2),
                                        pytest.param("llama_stream", 3, marks=pytest.mark.slow)])
def test_a_meta_device_model_trains_like_its_init_on_one_device(case, world, tmp_path, capfd):
    out = tmp_path / "out.json"
    assert launch([WORKER, case, str(out)], world, timeout_s=240, grace_s=5) == 0, capfd.readouterr()
    r = json.loads(out.read_text())
    assert r["worst"] == 0.0, r
    assert r["on_meta"], r  # the engine holds the parameters; the model keeps their shapes only


def test_pretrained_weights_load_into_the_shards(checkpoint, tmp_path, capfd):
    out = tmp_path / "out.json"
    assert launch([WORKER, "pretrained", str(out), str(checkpoint)], 2, timeout_s=240, grace_s=5) == 0, \
        capfd.readouterr()
    r = json.loads(out.read_text())
    assert r["logits"] == 0.0 and r["loss"] == 0.0, r
    assert r["worst"] == 0.0, r


def test_what_cannot_start_is_an_error_on_every_rank(checkpoint, tmp_path, capfd):
    assert launch([WORKER, "errors", str(tmp_path / "unused"), str(checkpoint)], 2, timeout_s=240, grace_s=5) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 8, lines
    no_init, real, mismatch, diverging = lines[0:2], lines[2:4], lines[4:6], lines[6:]
    for line in no_init:
        assert "no init gave these tensors of the meta-device model a value: pos; pass param_init_fn=(a function of one module), or give their modules a reset_parameters()" in line  # noqa: E501
    for line in real:
        assert "stream_init initializes a model built on the meta device, and this model's parameters all have values: build it under torch.device('meta'), or drop stream_init" in line  # noqa: E501
    for line in mismatch:
        assert "model.layers.2.self_attn.q_proj.weight" in line and "model.embed_tokens.weight" in line, line
    for line in diverging:
        assert "the parameter init gave the ranks different values (" in line and "blocks.0.qkv.weight" in line, line
        assert "): it does not follow the random seed alone; pass stream_init=True to initialize on rank 0 and send each rank its shards" in line  # noqa: E501


MEMORY_WORKER = str(Path(__file__).resolve().parent / "memory_worker.py")
#: glibc returns a freed block of 1 MiB or more to the system at once (by default its
#: threshold grows to the largest block freed, and the heap keeps what it frees below it):
#: resident memory then shows what the process holds, not what the allocator kept
ALLOCATOR = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}


def _grown(world: int, tmp_path) -> dict:
    out = tmp_path / f"memory{world}.json"
    assert launch([MEMORY_WORKER, str(out)], world, timeout_s=300, grace_s=5, env=ALLOCATOR) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # 40 s; the default tier trains meta-device models sharded (above) without the cap
def test_a_model_whose_training_state_exceeds_the_cap_trains_sharded_under_it(tmp_path):
    """The Llama's fp32 parameters, gradients and Adam state (752 MiB) exceed the cap
    (85% of them) that every rank's growth in resident memory stays under at world 2 and
    4; one process training it alone goes over. Initialize and capture never hold a
    full copy of the parameters (188 MiB): a rank's growth after initialize stays below
    them, and the first forward, which captures, adds less than half of them."""
    alone = _grown(1, tmp_path)
    cap = 0.85 * alone["state_mib"]
    assert max(alone["grown_mib"]) > cap, alone
    for world in (2, 4):
        r = _grown(world, tmp_path)
        assert max(r["grown_mib"]) <= cap, (world, cap, r)
        assert max(r["init_mib"]) < r["params_mib"], (world, r)
        assert max(c - i for c, i in zip(r["capture_mib"], r["init_mib"])) < r["params_mib"] / 2, (world, r)


@pytest.mark.parametrize("name", sorted(__import__("zoo").ZOO))
def test_every_zoo_model_on_meta_gets_the_values_of_its_own_init(name):
    """The engine's init of a meta-device model (world 1) against transformers' own on one
    device: ``to_empty``, then ``init_weights()`` (which initializes, then ties), from the
    same seed: tied embeddings, GPT-2's scaled residual projections (a parent's init
    setting its children's weights), T5's and BART's shared embeddings, BatchNorm's and
    rotary buffers; every parameter and buffer equal, bit for bit."""
    import dcir
    from zoo import ZOO

    def meta():
        torch.manual_seed(0)
        with torch.device("meta"):
            return ZOO[name].make()
    ref = meta()
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    ref.init_weights()
    drawn = torch.random.get_rng_state()
    model = meta()
    torch.manual_seed(0)
    engine = dcir.initialize(model, config={"timeout_s": 60})
    try:
        full, buffers = engine.full_parameters(), dict(model.named_buffers())
        assert [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), full[n])] == []
        assert [n for n, b in ref.named_buffers() if not torch.equal(b, buffers[n])] == []
        assert torch.equal(torch.random.get_rng_state(), drawn), "the init drew as many numbers as on one device"
    finally:
        torch.distributed.destroy_process_group()
