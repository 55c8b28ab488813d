"""Each error of ``runtime/checkpoint.py`` in full, as a user reads it, at one rank in
this process: a bad tag; a checkpoint that is missing, unfinished, damaged or of
another format; one that does not fit the engine loading it (its accumulation, its
optimizer's groups); a save the ZeRO-1 program cannot make. ``test_checkpoint.py``
raises them across ranks (the same error on every rank, the engine unchanged)."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dcir
from dcir_runtime import export_checkpoint
from models import mlp, squared


def _engine(model=None, optimizer=None, **config):
    torch.manual_seed(0)
    return dcir.initialize(model or mlp(), optimizer, config={"gradient_accumulation_steps": 2, **config},
                           loss_fn=squared)


def _micro_step(engine) -> None:
    engine.backward(engine(torch.randn(2, 8)))
    engine.step()


def _error(call) -> str:
    with pytest.raises(dcir.DcirError) as e:
        call()
    return e.value.render()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An engine (ZeRO-3, two micro-steps per optimizer step) and its checkpoints in
    ``root``: ``step1`` after one optimizer step, ``mid`` a micro-step later."""
    root = tmp_path_factory.mktemp("ckpt")
    engine = _engine()
    for _ in range(2):
        _micro_step(engine)
    engine.save_checkpoint(root)
    _micro_step(engine)
    engine.save_checkpoint(root, "mid")
    return SimpleNamespace(engine=engine, root=root)


def _copy(saved, tmp_path: Path, tag: str = "step1") -> Path:
    """A copy of ``saved``'s ``step1``, to damage, as ``tmp_path/<tag>``."""
    return Path(shutil.copytree(saved.root / "step1", tmp_path / tag))


def _largest_file(path: Path) -> tuple[str, int]:
    """The name and size of the checkpoint's largest data file, by its manifest."""
    files = json.loads((path / "COMPLETE").read_text())["files"]
    name = max((n for n in files if n.endswith(".distcp")), key=lambda n: files[n][0])
    return name, files[name][0]


def test_a_tag_that_is_not_a_plain_name(saved):
    assert _error(lambda: saved.engine.save_checkpoint(saved.root, "../up")) == (
        "error: bad checkpoint tag '../up'"
        ": letters, digits, '_', '.', '-' (not starting with '.' or '-'), not 'latest', no '.tmp-'")


def test_a_checkpoint_that_is_not_there_or_not_finished(saved, tmp_path):
    assert _error(lambda: saved.engine.load_checkpoint(saved.root, "step9")) == (
        f"error: no checkpoint 'step9' in {saved.root}; complete checkpoints there: mid, step1")
    path = _copy(saved, tmp_path, "step4")
    (path / "COMPLETE").unlink()
    assert _error(lambda: saved.engine.load_checkpoint(tmp_path, "step4")) == (
        f"error: {path} has no COMPLETE marker: the save that wrote it did not finish; not loading it")


def test_a_marker_that_is_unreadable_or_of_another_format(saved, tmp_path):
    path = _copy(saved, tmp_path)
    marker = json.loads((path / "COMPLETE").read_text())
    (path / "COMPLETE").write_text(json.dumps({**marker, "format": 99}))
    assert _error(lambda: saved.engine.load_checkpoint(tmp_path, "step1")) == (
        f"error: {path}: checkpoint format 99; this DCIR reads format 1")
    (path / "COMPLETE").write_text("{")
    assert _error(lambda: saved.engine.load_checkpoint(tmp_path, "step1")) == (
        f"error: {path / 'COMPLETE'} is unreadable (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)): the checkpoint is damaged")


def test_a_damaged_checkpoint_is_neither_loaded_nor_exported(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name, size = _largest_file(path)
    with open(path / name, "r+b") as f:
        f.truncate(100)
    problem = f"file {name} is truncated or changed: 100 bytes, the manifest says {size}"
    assert _error(lambda: saved.engine.load_checkpoint(tmp_path, "step1")) == (
        f"error: {path} is damaged; not loading it:\n  {problem}")
    assert _error(lambda: export_checkpoint(tmp_path, tmp_path / "out", "step1")) == (
        f"error: {path} is damaged; not exporting it:\n  {problem}")


def test_a_file_the_manifest_vouches_for_that_does_not_read(saved, tmp_path):
    """Written over, manifest and all: the files check out, and the reader's own error
    follows the checkpoint's name."""
    path = _copy(saved, tmp_path)
    name, size = _largest_file(path)
    junk = bytes(size)
    (path / name).write_bytes(junk)
    marker = json.loads((path / "COMPLETE").read_text())
    marker["files"][name] = [size, zlib.crc32(junk)]
    (path / "COMPLETE").write_text(json.dumps(marker))
    message = _error(lambda: saved.engine.load_checkpoint(tmp_path, "step1"))
    assert message.startswith(f"error: {path}: reading the checkpoint failed: "), message


def test_a_checkpoint_that_does_not_fit_the_engine(saved):
    """Saved inside accumulation of 2, loaded by an engine accumulating 4; saved with one
    optimizer parameter group, loaded by an optimizer with two."""
    four = _engine(gradient_accumulation_steps=4)
    assert _error(lambda: four.load_checkpoint(saved.root, "mid")) == (
        f"error: {saved.root / 'mid'} was saved at micro-step 3 inside gradient accumulation of 2; this engine "
        "accumulates 4: resume with the same accumulation")
    model = mlp()
    weights, biases = ([p for n, p in model.named_parameters() if n.endswith(end)] for end in ("weight", "bias"))
    grouped = _engine(model, torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}]))
    assert _error(lambda: grouped.load_checkpoint(saved.root, "step1")) == (
        f"error: {saved.root / 'step1'} has 1 optimizer parameter groups; this optimizer has 2")


def test_zero1_does_not_save_inside_accumulation(tmp_path):
    """Its per-rank gradient accumulators hold the micro-steps' sums, which a checkpoint
    does not reshard; at the optimizer step's boundary it saves."""
    engine = _engine(zero_stage=1)
    _micro_step(engine)
    assert _error(lambda: engine.save_checkpoint(tmp_path)) == (
        "error: save_checkpoint inside gradient accumulation (micro-step 1 of 2"
        ") under a program with per-rank gradient accumulators (zero1): those are not resharded; save at an optimizer-step boundary")  # noqa: E501
    _micro_step(engine)
    assert engine.save_checkpoint(tmp_path) == tmp_path / "step1"
