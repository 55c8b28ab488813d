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

import crc32c
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
        f"error: {path}: checkpoint format 99; this DCIR reads formats 1, 2")
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
    follows the checkpoint's name. DCP reads into the engine in place, so the engine
    then refuses to train, evaluate or save until a load succeeds."""
    path = _copy(saved, tmp_path)
    name, size = _largest_file(path)
    junk = bytes(size)
    (path / name).write_bytes(junk)
    marker = json.loads((path / "COMPLETE").read_text())
    marker["files"][name] = [size, crc32c.crc32c(junk)]
    (path / "COMPLETE").write_text(json.dumps(marker))
    engine = _engine()
    message = _error(lambda: engine.load_checkpoint(tmp_path, "step1"))
    assert message.startswith(f"error: {path}: reading the checkpoint failed: "), message
    overwritten = "the engine's parameters and optimizer state are partly overwritten: load a checkpoint before training on or saving"  # noqa: E501
    assert message.endswith("\n" + overwritten), message
    refused = (f"error: the engine's state is partly overwritten (reading {path} failed half-way"
               "): load a checkpoint before training on, evaluating or saving")
    assert _error(lambda: _micro_step(engine)) == refused
    with torch.no_grad():
        assert _error(lambda: engine(torch.randn(2, 8))) == refused
    assert _error(lambda: engine.save_checkpoint(tmp_path / "other")) == refused
    engine.load_checkpoint(saved.root, "step1")
    _micro_step(engine)


def test_a_checkpoint_of_format_1_loads(saved, tmp_path):
    """Format 1 (zlib's CRC-32, no count of parameter groups in the marker) loads as
    format 2 does, into fresh tensors first; its damage is named with its checksum."""
    path = _copy(saved, tmp_path)
    marker = json.loads((path / "COMPLETE").read_text())
    del marker["param_groups"]
    marker["format"] = 1
    marker["files"] = {n: [size, zlib.crc32((path / n).read_bytes())] for n, (size, _) in marker["files"].items()}
    (path / "COMPLETE").write_text(json.dumps(marker))
    old, new = _engine(), _engine()
    old.load_checkpoint(tmp_path, "step1")
    new.load_checkpoint(saved.root, "step1")
    for a, b in zip(old.shards.values(), new.shards.values()):
        assert torch.equal(a, b) and torch.equal(old.optimizer.state[a]["exp_avg"], new.optimizer.state[b]["exp_avg"])
    name, size = _largest_file(path)
    with open(path / name, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff")
    assert _error(lambda: old.load_checkpoint(tmp_path, "step1")) == (
        f"error: {path} is damaged; not loading it:\n  file {name} is corrupt: its CRC-32 differs from the manifest's")


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
        ") under a program with per-rank gradient accumulators (zero1; HSDP's across nodes): those are not resharded; save at an optimizer-step boundary")  # noqa: E501
    _micro_step(engine)
    assert engine.save_checkpoint(tmp_path) == tmp_path / "step1"


def _steps(engine, root, n: int, **save) -> list[str]:
    """``n`` optimizer steps, each saved; the tags."""
    tags = []
    for _ in range(n):
        for _ in range(2):
            _micro_step(engine)
        tags.append(engine.save_checkpoint(root, **save).name)
    return tags


def test_a_save_that_fails_leaves_the_previous_checkpoint_latest(tmp_path):
    """A disk that fills during a save (a file-size limit on this process: the write
    fails with EFBIG, as a full filesystem's with ENOSPC): the error says so and that the
    previous checkpoint stays the latest; what the save wrote is gone; the next save works."""
    import resource

    engine = _engine()
    _steps(engine, tmp_path, 1)
    for _ in range(2):
        _micro_step(engine)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        message = _error(lambda: engine.save_checkpoint(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert message == (f"error: saving checkpoint 'step2' in {tmp_path} failed on rank 0: [Errno 27] File too large "
                       "(this process's file-size limit, RLIMIT_FSIZE, is 1024 bytes); nothing was saved: 'step1' "
                       "stays the latest checkpoint"), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]
    assert engine.load_checkpoint(tmp_path)[0] == tmp_path / "step1"
    assert engine.steps == 1
    _steps(engine, tmp_path, 1)
    assert (tmp_path / "latest").read_text() == "step2\n"


def test_leftovers_of_killed_saves_go_and_keep_last_keeps_the_newest(tmp_path):
    engine = _engine()
    (tmp_path / "step9.tmp-0badc0de").mkdir(parents=True)
    (tmp_path / "step9.tmp-0badc0de" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".latest.tmp-0badc0de").write_text("step9\n")
    assert _steps(engine, tmp_path, 4, keep_last=2) == ["step1", "step2", "step3", "step4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step3", "step4"]
    _steps(engine, tmp_path, 1)  # without keep_last nothing complete goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step3", "step4", "step5"]
    assert _error(lambda: engine.save_checkpoint(tmp_path, keep_last=0)) == (
        "error: keep_last: how many of the newest complete checkpoints to keep, 1 or more (None: all); not 0")


def test_a_damaged_latest_falls_back_to_the_newest_good_one(tmp_path, caplog):
    """With no tag, a load skips damaged checkpoints, newest first, and says which; a
    tag still loads only that one; when every checkpoint is damaged, none loads."""
    engine = _engine()
    _steps(engine, tmp_path, 3)
    name, size = _largest_file(tmp_path / "step3")
    with open(tmp_path / "step3" / name, "r+b") as f:  # one bit-flipped byte
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(tmp_path / "step2" / name, "r+b") as f:
        f.truncate(100)
    with caplog.at_level("WARNING", logger="dcir"):
        path, _ = engine.load_checkpoint(tmp_path)
    assert path == tmp_path / "step1" and engine.steps == 1
    corrupt = f"file {name} is corrupt: its CRC-32C differs from the manifest's"
    truncated = f"file {name} is truncated or changed: 100 bytes, the manifest says {size}"
    assert caplog.messages == [f"dcir: {tmp_path / 'step3'} is damaged ({corrupt}); {tmp_path / 'step2'} is damaged "
                               f"({truncated}); loading {tmp_path / 'step1'}, the newest complete checkpoint that is "
                               "not"]
    assert _error(lambda: engine.load_checkpoint(tmp_path, "step3")) == (
        f"error: {tmp_path / 'step3'} is damaged; not loading it:\n  {corrupt}")
    (tmp_path / "step1" / "COMPLETE").write_text("{")
    unreadable = (f"{tmp_path / 'step1' / 'COMPLETE'} is unreadable (Expecting property name enclosed in double "
                  "quotes: line 1 column 2 (char 1)): the checkpoint is damaged")
    assert _error(lambda: engine.load_checkpoint(tmp_path)) == (
        f"error: every complete checkpoint in {tmp_path} is damaged; not loading any:\n"
        f"  {tmp_path / 'step3'}: {corrupt}\n  {tmp_path / 'step2'}: {truncated}\n  {tmp_path / 'step1'}: {unreadable}")
    assert engine.steps == 1


def test_a_save_whose_cleaning_fails_after_the_commit_says_it_was_committed(tmp_path, monkeypatch):
    from dcir_runtime import checkpoint

    engine = _engine()

    def broken(*args):
        raise OSError("[Errno 5] Input/output error")

    monkeypatch.setattr(checkpoint, "_clean", broken)
    assert _error(lambda: _steps(engine, tmp_path, 1)) == (
        f"error: committing checkpoint 'step1' in {tmp_path} failed on rank 0: [Errno 5] Input/output error"
        "; the checkpoint was committed: 'step1' is the latest")
    assert checkpoint.latest(tmp_path) == "step1"


def test_a_peer_that_stalls_in_a_checkpoint_collective():
    """gloo's timeout inside a save's or load's exchange: one line that names it, no traceback."""
    from dcir_runtime import checkpoint

    def timed_out():
        raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")

    assert _error(lambda: checkpoint._collective("saving checkpoint 'step5' in ckpt", timed_out)) == (
        "error: saving checkpoint 'step5' in ckpt: the ranks could not exchange their state ([../gloo/transport/"
        "tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
        "); a rank that crashed or stalled leaves the others waiting here")
