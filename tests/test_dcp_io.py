"""``DirectReader`` reads what DCP's own ``FileSystemReader`` reads, bit for bit: 1-D
chunks and 0-D tensors straight into their targets, everything else through DCP's path;
``FlatChunk`` takes any range of a flat tensor. Across ranks, ``test_checkpoint.py``'s
resharding tests load through both."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp

from dcir_runtime import dcp_io
from dcir_runtime.dcp_io import DirectReader, FlatChunk, FlatLoadPlanner, FlatSavePlanner


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"flat": torch.randn(1000, generator=g), "bf16": torch.randn(77, generator=g).to(torch.bfloat16),
            "matrix": torch.randn(5, 7, generator=g), "empty": torch.empty(0), "step": torch.tensor(3.0),
            "wider": torch.randn(40, generator=g), "blob": b"\x00pickled\xff"}


def _targets(state: dict) -> dict:
    out = {k: torch.full_like(v, float("nan")) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    out["wider"] = torch.zeros(40, dtype=torch.float64)  # another dtype than stored: DCP's path converts
    return out


def test_the_direct_reader_reads_what_dcp_reads(tmp_path, monkeypatch):
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    theirs, ours = _targets(state), _targets(state)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    direct = []
    original = DirectReader._direct

    def counted(self, f, req, planner):
        took = original(self, f, req, planner)
        direct.extend([req.storage_index.fqn] if took else [])
        return took

    monkeypatch.setattr(DirectReader, "_direct", counted)
    dcp.load(ours, storage_reader=DirectReader(tmp_path), planner=FlatLoadPlanner(), no_dist=True)
    assert sorted(direct) == ["bf16", "flat", "step"]  # 1-D and 0-D, of the dtype they are read into
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
            assert torch.equal(ours[key], value.to(ours[key].dtype)), key
        else:
            assert ours[key] == theirs[key] == value


def test_a_target_that_cannot_be_read_into_directly_goes_through_dcp(tmp_path, monkeypatch):
    """A non-contiguous target, and an archive in a byte order other than this
    machine's, are read by DCP's own path."""
    state = {"flat": torch.arange(12.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    by_dcp = []
    original = dcp.FileSystemReader.read_data

    def spied(self, plan, planner):
        by_dcp.extend(req.storage_index.fqn for req in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", spied)
    strided = torch.zeros(24)[::2]
    dcp.load({"flat": strided}, storage_reader=DirectReader(tmp_path), no_dist=True)
    assert by_dcp == ["flat"] and torch.equal(strided, state["flat"])
    flat = torch.zeros(12)
    dcp.load({"flat": flat}, storage_reader=DirectReader(tmp_path), no_dist=True)
    assert by_dcp == ["flat"] and torch.equal(flat, state["flat"])  # contiguous: read directly
    monkeypatch.setattr(dcp_io, "sys", SimpleNamespace(byteorder="big"))
    flat.zero_()
    dcp.load({"flat": flat}, storage_reader=DirectReader(tmp_path), no_dist=True)
    assert by_dcp == ["flat", "flat"] and torch.equal(flat, state["flat"])


def test_flat_chunks_read_any_range_of_a_flat_tensor(tmp_path):
    """A flat tensor saved whole, read back as three ranges of another world's split
    (uneven, one empty), each into a padded buffer as the engine holds its shards."""
    whole = torch.randn(10, generator=torch.Generator().manual_seed(1))
    dcp.save({"w": whole}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    for start, stop in ((0, 4), (4, 8), (8, 10), (10, 10)):
        padded = torch.full((4,), float("nan"))
        dcp.load({"w": FlatChunk(padded[:stop - start], start, 10)}, storage_reader=DirectReader(tmp_path),
                 planner=FlatLoadPlanner(), no_dist=True)
        assert torch.equal(padded[:stop - start], whole[start:stop]) and padded[stop - start:].isnan().all()


def test_flat_chunks_save_as_dcp_saves_the_tensor(tmp_path):
    """Saved as a FlatChunk (here one rank's: the whole tensor), a flat tensor's entry in
    DCP's metadata is the one DCP makes for the tensor itself, and it reads back."""
    whole = torch.randn(10, generator=torch.Generator().manual_seed(2))
    padded = torch.cat([whole, torch.zeros(2)])
    mine, plain = tmp_path / "flat", tmp_path / "plain"
    dcp.save({"w": FlatChunk(padded[:10], 0, 10), "b": b"bytes"}, storage_writer=dcp.FileSystemWriter(mine),
             planner=FlatSavePlanner(), no_dist=True)
    dcp.save({"w": whole, "b": b"bytes"}, storage_writer=dcp.FileSystemWriter(plain), no_dist=True)
    ours, theirs = (DirectReader(d).read_metadata().state_dict_metadata for d in (mine, plain))
    assert ours == theirs
    back = {"w": FlatChunk(torch.zeros(10), 0, 10), "b": None}
    dcp.load(back, storage_reader=DirectReader(mine), planner=FlatLoadPlanner(), no_dist=True)
    assert torch.equal(back["w"].local, whole) and back["b"] == b"bytes"
