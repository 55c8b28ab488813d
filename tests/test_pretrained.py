"""Pretrained checkpoints read into shards (runtime/pretrained.py): every rank's shard of
every parameter of a tiny Hugging Face Llama saved by ``save_pretrained`` (one file and
sharded, tied and untied embeddings) equals the engine's own ``flat_shard``, read through
row slices only; a checkpoint that does not fit the model is one error listing it all."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from dcir.diagnostics import DcirError
from dcir_lowering.calls import flat_shard
from dcir_runtime.pretrained import aliases_of
from dcir_runtime.pretrained import Checkpoint


def _llama(tied: bool, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(dtype)


def _expected(model: torch.nn.Module) -> dict:
    """What the engine expects: first FQN -> (shape, every FQN), parameters then persistent buffers."""
    params = dict(model.named_parameters())
    persistent = set(model.state_dict())
    buffers = {n: (tuple(b.shape), [n]) for n, b in model.named_buffers() if n in persistent}
    return {n: (tuple(params[n].shape), names) for n, names in aliases_of(model).items()} | buffers


def _shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The engine's own layout: materialize.flat_shard for this rank and world."""
    return flat_shard(full, rank, world)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, directory) for tied/untied x single/sharded, and a bf16 model saved once."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for tied in (True, False):
        model = _llama(tied)
        for layout, kwargs in (("single", {}), ("sharded", {"max_shard_size": "20KB"})):
            path = root / f"{'tied' if tied else 'untied'}-{layout}"
            model.save_pretrained(path, safe_serialization=True, **kwargs)
            out[tied, layout] = (model, path)
    bf16 = _llama(True, torch.bfloat16)
    bf16.save_pretrained(root / "bf16", safe_serialization=True, max_shard_size="20KB")
    out["bf16"] = (bf16, root / "bf16")
    return out


class _Recorder:
    """Wraps ``safetensors.safe_open``: records every data read (``get_slice(name)[key]``,
    ``get_tensor(name)``) and how many files are open at once."""

    def __init__(self, real):
        self.real, self.reads, self.open_now, self.most_open = real, [], 0, 0

    def __call__(self, *args, **kwargs):
        self.open_now += 1  # a file is open from safe_open() until its __exit__
        self.most_open = max(self.most_open, self.open_now)
        return _RecordedFile(self, self.real(*args, **kwargs))


class _RecordedFile:
    def __init__(self, recorder: _Recorder, handle):
        self.recorder, self.handle = recorder, handle

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        self.recorder.open_now -= 1
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        self.recorder.reads.append((name, "whole"))
        return self.handle.get_tensor(name)

    def get_slice(self, name):
        return _Slice(name, self.handle.get_slice(name), self.recorder.reads)


class _Slice:
    def __init__(self, name, real, reads):
        self.name, self.real, self.reads = name, real, reads

    def get_shape(self):
        return self.real.get_shape()

    def get_dtype(self):
        return self.real.get_dtype()

    def __getitem__(self, key):
        self.reads.append((self.name, key))
        return self.real[key]


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", rec)
    return rec


# ---- shards equal the engine's layout ------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_every_rank_reads_the_engines_shard_of_every_parameter(saved, tied, layout):
    model, path = saved[tied, layout]
    expected = _expected(model)
    assert ("lm_head.weight" in expected["model.embed_tokens.weight"][1]) == tied
    with Checkpoint.open(path) as ckpt:
        if layout == "sharded":
            assert len({s.file for s in ckpt.tensors.values()}) > 1
        ckpt.check(expected)
        for name, p in model.named_parameters(remove_duplicate=False):  # every alias of tied weights too
            for world in (1, 2, 3):
                shards = [ckpt.read_shard(name, rank, world, torch.float32) for rank in range(world)]
                for rank, shard in enumerate(shards):
                    assert torch.equal(shard, _shard_of(p.detach(), rank, world)), (name, rank, world)


def test_bf16_checkpoint_read_as_fp32(saved):
    model, path = saved["bf16"]
    with Checkpoint.open(path) as ckpt:
        ckpt.check(_expected(model))
        for name, p in model.named_parameters():
            assert ckpt.read_shard(name, 0, 2).dtype == torch.bfloat16  # default: as stored
            for rank in range(3):
                shard = ckpt.read_shard(name, rank, 3, torch.float32)
                assert shard.dtype == torch.float32
                assert torch.equal(shard, _shard_of(p.detach().to(torch.float32), rank, 3)), (name, rank)


def test_either_name_of_tied_weights_is_found(saved, tmp_path):
    model, _ = saved[True, "single"]
    state = {n: t.clone() for n, t in model.state_dict().items() if n != "model.embed_tokens.weight"}
    save_file(state, str(tmp_path / "only-lm-head.safetensors"))
    both = dict(state, **{"model.embed_tokens.weight": state["lm_head.weight"].clone()})
    save_file(both, str(tmp_path / "both.safetensors"))  # what dcir-checkpoint export writes
    full = model.get_input_embeddings().weight.detach()
    for file in ("only-lm-head.safetensors", "both.safetensors"):
        with Checkpoint.open(tmp_path / file) as ckpt:
            ckpt.check(_expected(model))
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                assert torch.equal(ckpt.read_shard(name, 1, 2), _shard_of(full, 1, 2))


def test_scalars_vectors_and_tensors_smaller_than_the_world(tmp_path):
    tensors = {"scalar": torch.tensor(2.5), "pair": torch.tensor([1.0, 2.0]), "seven": torch.arange(7.0),
               "cube": torch.arange(60.0).reshape(3, 4, 5), "empty": torch.zeros(0, 4), "flat": torch.zeros(4, 0),
               "ints": torch.arange(10).reshape(5, 2)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with Checkpoint.open(tmp_path / "t.safetensors") as ckpt:
        ckpt.check({n: (t.shape, [n]) for n, t in tensors.items()})
        for name, full in tensors.items():
            for world in (1, 2, 3, 4, 8):
                for rank in range(world):
                    shard = ckpt.read_shard(name, rank, world)
                    assert shard.dtype == full.dtype and torch.equal(shard, _shard_of(full, rank, world))
        assert torch.equal(ckpt.read("cube"), tensors["cube"])
        assert ckpt.read("ints", torch.float64).dtype == torch.float64


def test_optional_buffer_may_be_absent_and_a_present_buffer_reads_whole(saved, tmp_path):
    model, path = saved[False, "single"]
    expected = _expected(model) | {"model.rotary_emb.inv_freq": ((4,), ["model.rotary_emb.inv_freq"])}
    with Checkpoint.open(path) as ckpt:
        ckpt.check(expected, optional={"model.rotary_emb.inv_freq"})
        with pytest.raises(DcirError, match="1 missing, 0 unexpected, 0 mis-shaped"):
            ckpt.check(expected)
    state = dict(model.state_dict(), **{"model.rotary_emb.inv_freq": torch.arange(4.0)})
    save_file({n: t.contiguous() for n, t in state.items()}, str(tmp_path / "with-buffer.safetensors"))
    with Checkpoint.open(tmp_path / "with-buffer.safetensors") as ckpt:
        ckpt.check(expected, optional={"model.rotary_emb.inv_freq"})
        assert torch.equal(ckpt.read("model.rotary_emb.inv_freq"), torch.arange(4.0))


# ---- memory: headers at open, rows of the shard only, one file at a time --------------------

def test_reads_only_the_rows_of_the_shard_and_one_file_at_a_time(saved, recorder):
    model, path = saved[True, "sharded"]
    with Checkpoint.open(path) as ckpt:
        ckpt.check(_expected(model))
        assert recorder.reads == [] and recorder.most_open == 1  # headers only, one file at a time
        sliced = 0
        for name, stored in ckpt.tensors.items():
            rows, row = stored.shape[0], stored.numel // stored.shape[0]
            for world in (2, 3):
                chunk = -(-stored.numel // world)
                for rank in range(world):
                    recorder.reads.clear()
                    ckpt.read_shard(name, rank, world, torch.float32)
                    [(read, key)] = recorder.reads
                    assert read == name and isinstance(key, slice), key
                    lo, hi = rank * chunk, min((rank + 1) * chunk, stored.numel)
                    assert lo // row <= key.start <= key.stop <= -(-hi // row) <= rows
                    assert key.stop - key.start <= chunk // row + 2
                    if rows > 2:
                        assert key.stop - key.start < rows, f"{name}: the whole tensor was read"
                        sliced += 1
        assert sliced > 50 and recorder.most_open == 1
    assert recorder.open_now == 0


def test_a_failed_check_reads_nothing(saved, recorder):
    model, path = saved[False, "sharded"]
    expected = _expected(model)
    expected["model.norm.weight"] = ((33,), ["model.norm.weight"])
    with Checkpoint.open(path) as ckpt, pytest.raises(DcirError):
        ckpt.check(expected)
    assert recorder.reads == [] and recorder.open_now == 0


# ---- errors -------------------------------------------------------------------------------

def test_check_lists_missing_unexpected_and_misshaped_keys_in_one_error(saved):
    model, path = saved[False, "sharded"]
    expected = _expected(model)
    del expected["model.layers.1.mlp.up_proj.weight"]
    expected["model.extra.weight"] = ((4, 4), ["model.extra.weight", "model.extra_alias.weight"])
    expected["model.norm.weight"] = ((33,), ["model.norm.weight"])
    with Checkpoint.open(path) as ckpt, pytest.raises(DcirError) as e:
        ckpt.check(expected)
    text = str(e.value)
    assert len(e.value.diagnostics) == 1
    assert f"{path} does not match the model: 1 missing, 1 unexpected, 1 mis-shaped keys" in text
    assert "missing from the checkpoint (a tied parameter by each of its names):" in text
    assert "  model.extra.weight or model.extra_alias.weight" in text
    assert "in the checkpoint but not in the model:\n  model.layers.1.mlp.up_proj.weight" in text
    assert "shaped differently:\n  model.norm.weight: [32] in the checkpoint, [33] in the model" in text


def test_long_lists_are_capped(saved):
    model, path = saved[False, "single"]
    expected = _expected(model) | {f"extra.{i}": ((1,), [f"extra.{i}"]) for i in range(25)}
    with Checkpoint.open(path) as ckpt, pytest.raises(DcirError) as e:
        ckpt.check(expected)
    text = str(e.value)
    assert "extra.19\n" in text and "extra.20" not in text and "  ... and 5 more" in text
    assert "25 missing, 0 unexpected, 0 mis-shaped keys" in text


def _error(path) -> str:
    with pytest.raises(DcirError) as e:
        Checkpoint.open(path)
    assert str(path) in str(e.value)
    return str(e.value)


def test_bad_paths_say_what_was_expected(tmp_path, saved):
    expected = "expected a .safetensors file, a .safetensors.index.json file, or a directory holding " \
               "model.safetensors or model.safetensors.index.json"
    assert "it does not exist; expected" in _error(tmp_path / "nowhere.safetensors")
    assert expected in _error(tmp_path / "nowhere.safetensors")
    (tmp_path / "weights.pt").write_bytes(b"x")
    assert "is not a safetensors checkpoint: expected" in _error(tmp_path / "weights.pt")
    (tmp_path / "empty").mkdir()
    assert "holds no checkpoint: expected" in _error(tmp_path / "empty")
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"x")
    assert "it holds pytorch_model.bin: only safetensors checkpoints are read" in _error(tmp_path / "empty")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert "is not a readable safetensors file" in _error(tmp_path / "junk.safetensors")


def test_bad_indexes(tmp_path, saved):
    _, path = saved[False, "sharded"]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    shard_file = sorted(set(index["weight_map"].values()))[1]
    (copy / shard_file).unlink()
    text = _error(copy)
    assert "names shard files missing from" in text and shard_file in text
    assert "names shard files missing from" in _error(copy / "model.safetensors.index.json")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    index["weight_map"]["model.not.there"] = shard_file
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    text = _error(other)
    assert "the index maps tensors to shard files that do not hold them" in text
    assert f"model.not.there (in {shard_file})" in text
    (other / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert 'has no weight_map: expected a JSON object with "weight_map":' in _error(other)
    (other / "model.safetensors.index.json").write_text("{not json")
    assert "is not a readable safetensors index" in _error(other)


def test_unknown_names_and_ranks(saved):
    model, path = saved[True, "single"]
    with Checkpoint.open(path) as ckpt:
        with pytest.raises(DcirError, match="holds no tensor named lm_head.weight") as e:
            ckpt.read_shard("lm_head.weight", 0, 1)  # a tied alias, before check
        assert "(a tied parameter's other names are known only after check(expected))" in str(e.value)
        with pytest.raises(DcirError, match="is outside a world of 2"):
            ckpt.read_shard("model.norm.weight", 2, 2)
        ckpt.check(_expected(model))
        with pytest.raises(DcirError, match="holds no tensor named model.nothing"):
            ckpt.read("model.nothing")



def test_what_is_read_does_not_share_memory_with_the_file(tmp_path):
    """safetensors maps the file (get_tensor and get_slice return views of the map): what
    is returned must not change, or fault, when the file is written in place later."""
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.ones(4, 3)}, str(path))
    with Checkpoint.open(path) as ckpt:
        whole, shard, world_of_one = ckpt.read("w"), ckpt.read_shard("w", 1, 2), ckpt.read_shard("w", 0, 1)
    with open(path, "r+b") as f:  # the last 12 elements of the file: every element of w
        f.seek(-4 * 12, 2)
        f.write(torch.full((12,), 7.0).numpy().tobytes())
    with Checkpoint.open(path) as ckpt:
        assert torch.equal(ckpt.read("w"), torch.full((4, 3), 7.0))  # the write reached the file
    assert torch.equal(whole, torch.ones(4, 3)) and torch.equal(shard, torch.ones(6))
    assert torch.equal(world_of_one, torch.ones(12))
