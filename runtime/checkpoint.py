"""Checkpoints of an Engine on ``torch.distributed.checkpoint`` (DCP): save, resume,
reshard, export.

``engine.save_checkpoint(dir, tag=None)`` writes, with every rank writing only its own
shards (DCP's ``FileSystemWriter``), everything a run needs to continue on the same
trajectory: the parameter shards, the optimizer state (host-resident offloaded state
included), the partial gradients when saved inside gradient accumulation, the step
counts, the RNG states, the LR scheduler and loss scaler when the engine has them, and
the caller's ``client_state``. ``engine.load_checkpoint(dir, tag=None)`` reads it back
at any world size, ZeRO stage or offload setting: each parameter is saved as the shards
of its flat, unpadded elements (each rank's range, the engine's layout less its
padding: ``dcp_io.FlatChunk``, stored as DCP stores a DTensor ``Shard(0)``), so DCP
reshards on load.

A checkpoint becomes visible only when complete: the ranks write ``DIR/<tag>.tmp-<nonce>/``;
after a barrier rank 0 writes ``COMPLETE`` (the step, the world, a manifest of every
file with its size and CRC-32C) and renames the directory to ``DIR/<tag>/``, then points
``DIR/latest`` at it (a temporary file and ``os.replace``). Loading trusts no directory
without its marker, checks every file against the manifest and every key against the
engine before it changes anything, so a bad checkpoint is an error that names the
problem and leaves the engine as it was. DCP then reads into the engine's own tensors,
in place; a read that fails half-way leaves the engine refusing to train or save until a
load succeeds.

``export(ckpt_dir, out_dir)`` (also ``dcir-checkpoint export``) consolidates a
checkpoint on one process, without a process group, into ``model.safetensors`` under
the model's own names, plus ``config.json`` for a ``transformers`` model, so
``from_pretrained(out_dir)`` or ``load_state_dict`` loads it. See docs/checkpoint.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import re
import resource
import secrets
import shutil
import signal
import sys
import time
import warnings
import zlib
from pathlib import Path

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dcir.diagnostics import DcirError, Diagnostic
from dcir.layout import ShardLayout
from dcir_runtime.dcp_io import DirectReader, FlatChunk, FlatLoadPlanner, FlatSavePlanner

MARKER = "COMPLETE"
LATEST = "latest"
FORMAT = 2
#: Each format's checksum of a file, by name: format 1 wrote zlib's CRC-32, format 2
#: writes CRC-32C (the Castagnoli polynomial, in hardware on x86 and ARM: 4x zlib's
#: speed here); this DCIR reads both
CHECKSUMS = {1: ("CRC-32", zlib.crc32), 2: ("CRC-32C", crc32c.crc32c)}
#: Test-only: ``DCIR_TEST_KILL_IN_SAVE=1`` makes every rank SIGKILL itself after its
#: shards are written and before the commit, the way a job killed mid-save dies.
KILL_IN_SAVE = "DCIR_TEST_KILL_IN_SAVE"
log = logging.getLogger("dcir")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def _error(message: str) -> DcirError:
    return DcirError(Diagnostic(message))


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag == LATEST or ".tmp-" in tag:
        raise _error(f"bad checkpoint tag {tag!r}: letters, digits, '_', '.', '-' (not starting with '.' or '-'), "
                     f"not {LATEST!r}, no '.tmp-'")
    return tag


# ---- the engine's state as DCP sees it -------------------------------------------------------

def _numel(engine, name: str) -> int:
    return engine.shapes[name].numel()


def _layout(engine, name: str) -> ShardLayout:
    return ShardLayout(_numel(engine, name), engine.process_group.shard_world)


def _local(engine, name: str, padded: torch.Tensor) -> torch.Tensor:
    """The unpadded part of this rank's flat shard (torch.chunk's split of ``numel``)."""
    return padded.reshape(-1)[:_layout(engine, name).local_numel(engine.process_group.shard_rank)]


def _chunk(engine, name: str, padded: torch.Tensor) -> FlatChunk:
    """This rank's elements of parameter ``name``'s flat tensor, held in ``padded``: what
    a save writes and a load reads into."""
    start, _ = _layout(engine, name).range_of(engine.process_group.shard_rank)
    return FlatChunk(_local(engine, name, padded.detach()), start, _numel(engine, name))


def _empty_chunk(engine, name: str, dtype: torch.dtype) -> FlatChunk:
    return _chunk(engine, name, torch.empty(_layout(engine, name).chunk, dtype=dtype))  # DCP fills every element


def _blob(obj) -> bytes:
    return pickle.dumps(obj)


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    buffers = dict(model.named_buffers())
    return {k: buffers[k] for k in model.state_dict(keep_vars=True) if k in buffers}


def _accumulating(engine) -> bool:
    return engine.micro_steps % engine.config.gradient_accumulation_steps != 0


def _state_dict(engine, client_state) -> dict:
    sd: dict = {}
    for name, shard in engine.shards.items():
        sd[name] = _chunk(engine, name, shard)
        if _accumulating(engine) and shard.grad is not None:
            sd[f"grad.{name}"] = _chunk(engine, name, shard.grad)
        for key, value in engine.optimizer.state.get(shard, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == shard.shape:
                sd[f"optim.{name}.{key}"] = _chunk(engine, name, value)
            elif isinstance(value, torch.Tensor):
                sd[f"optim.{name}.{key}"] = value.detach().cpu()
            else:
                sd[f"optim.{name}.{key}"] = _blob(value)
    for name, b in _persistent_buffers(engine.model).items():
        sd[name] = b.detach().cpu()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    sd["optim.param_groups"] = _blob(groups)
    sd["dcir.engine"] = _blob({"steps": engine.steps, "micro_steps": engine.micro_steps})
    sd["dcir.client_state"] = _blob(client_state)
    sd[f"dcir.rng.{engine.rank}"] = torch.get_rng_state()
    if torch.cuda.is_available():
        sd[f"dcir.cuda_rng.{engine.rank}"] = torch.cuda.get_rng_state()
    for attr in ("lr_scheduler", "loss_scaler"):
        if getattr(engine, attr, None) is not None:
            sd[f"dcir.{attr}"] = _blob(getattr(engine, attr).state_dict())
    return sd


def _manifest_of_model(engine) -> dict:
    return {"parameters": {n: {"shape": list(engine.shapes[n]), "aliases": engine.aliases[n],
                               "dtype": str(s.dtype).removeprefix("torch.")} for n, s in engine.shards.items()},
            "buffers": sorted(_persistent_buffers(engine.model))}


# ---- files -----------------------------------------------------------------------------------

def _crc(path: Path, fmt: int = FORMAT) -> int:
    """The checksum of format ``fmt`` of the file at ``path``, read in blocks into one
    buffer (a fresh block per read would fault in fresh pages each time)."""
    checksum, crc = CHECKSUMS[fmt][1], 0
    block = bytearray(1 << 22)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            crc = checksum(view[:n], crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _mine(files: list[str], rank: int, world: int) -> list[str]:
    """The files this rank checksums: its share, by position, of the sorted list."""
    return [f for i, f in enumerate(sorted(files)) if i % world == rank]


def _step_of(tag_dir: Path) -> int:
    try:
        return int(json.loads((tag_dir / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def latest(ckpt_dir) -> str | None:
    """The tag of the newest complete checkpoint in ``ckpt_dir`` (``latest`` if it
    names one with its marker, else the complete one with the highest step), or None."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if _TAG.fullmatch(tag) and (root / tag / MARKER).is_file():
            return tag
    done = [d for d in root.iterdir() if d.is_dir() and ".tmp-" not in d.name and (d / MARKER).is_file()]
    return max(done, key=lambda d: (_step_of(d), d.stat().st_mtime)).name if done else None


def _resolve(ckpt_dir, tag: str | None) -> Path:
    root = Path(ckpt_dir)
    if tag is None:
        tag = latest(root)
        if tag is None:
            partial = sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
            seen = (f" (directories without a {MARKER} marker, unfinished saves: {', '.join(partial)})"
                    if partial else "")
            raise _error(f"no complete checkpoint in {root}{seen}")
    path = root / _check_tag(tag)
    if not path.is_dir():
        have = sorted(d.name for d in root.iterdir() if d.is_dir() and (d / MARKER).is_file()) if root.is_dir() else []
        raise _error(f"no checkpoint {tag!r} in {root}; complete checkpoints there: {', '.join(have) or 'none'}")
    if not (path / MARKER).is_file():
        raise _error(f"{path} has no {MARKER} marker: the save that wrote it did not finish; not loading it")
    return path


def _read_marker(path: Path) -> dict:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise _error(f"{path / MARKER} is unreadable ({e}): the checkpoint is damaged") from None
    if marker.get("format") not in CHECKSUMS:
        raise _error(f"{path}: checkpoint format {marker.get('format')!r}; this DCIR reads formats "
                     f"{', '.join(map(str, CHECKSUMS))}")
    return marker


def _verify_files(path: Path, marker: dict, rank: int, world: int) -> list[str]:
    """Problems with the files against the manifest: sizes on every rank, checksums
    of this rank's share."""
    problems = []
    files = marker["files"]
    for name, (size, _) in sorted(files.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"file {name} is missing")
        elif f.stat().st_size != size:
            problems.append(f"file {name} is truncated or changed: {f.stat().st_size} bytes, the manifest says {size}")
    if problems:
        return problems
    for name in _mine(list(files), rank, world):
        if _crc(path / name, marker["format"]) != files[name][1]:
            checksum = CHECKSUMS[marker["format"]][0]
            problems.append(f"file {name} is corrupt: its {checksum} differs from the manifest's")
    return problems


def _collective(what: str, fn, *args, **kwargs) -> None:
    """A collective of the checkpoint over the process group; a peer that died or stalled
    past the timeout is an error that says so, on this rank, not gloo's traceback."""
    try:
        fn(*args, **kwargs)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _error(f"{what}: the ranks could not exchange their state ({reason}); a rank that crashed or "
                     "stalled leaves the others waiting here") from None


def _agree(problems: list[str], world: int) -> list[str]:
    """Every rank's problems, on every rank (so all raise the same error together)."""
    if world == 1:
        return problems
    everyone = [None] * world
    _collective("checking the checkpoint's files", dist.all_gather_object, everyone, problems)
    return sorted({p for ps in everyone for p in ps})


# ---- save ------------------------------------------------------------------------------------

def _agreed(world: int, what: str, fn):
    """Runs ``fn()`` on this rank and returns every rank's result, or raises the first
    failing rank's error on every rank together (no rank is left waiting in a barrier
    for one that failed)."""
    try:
        mine = ("ok", fn())
    except CheckpointException as e:  # DCP's, on every rank, with the failing ranks' errors
        mine = ("failed", _reason(e)) if world == 1 or dist.get_rank() in e.failures else ("elsewhere", _reason(e))
    except Exception as e:
        mine = ("failed", _reason(e))
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        _collective(what, dist.all_gather_object, everyone, mine)
    failed = ([(r, reason) for r, (status, reason) in enumerate(everyone) if status == "failed"]
              or [(r, reason) for r, (status, reason) in enumerate(everyone) if status == "elsewhere"])
    if failed:
        raise _error(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    return [result for _, result in everyone]


def _reason(e: BaseException) -> str:
    """One line for an exception: DCP's first failure (not its tracebacks), or the error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, DcirError):
        return e.diagnostics[0].message
    return str(e).strip().splitlines()[0][:500] if str(e).strip() else type(e).__name__


def _check_savable(engine) -> None:
    engine.execution.check_loaded()
    if _accumulating(engine) and any("grad_acc.of" in d.attrs for d in (engine.module.decls.values()
                                                                        if engine.module is not None else ())):
        raise _error(f"save_checkpoint inside gradient accumulation (micro-step {engine.micro_steps} of "
                     f"{engine.config.gradient_accumulation_steps}) under a program with per-rank gradient "
                     "accumulators (zero1; HSDP's across nodes): those are not resharded; save at an optimizer-step "
                     "boundary")


def _check_keep(keep_last) -> int | None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise _error(f"keep_last: how many of the newest complete checkpoints to keep, 1 or more (None: all); "
                     f"not {keep_last!r}")
    return keep_last


def save(engine, ckpt_dir, tag: str | None = None, client_state=None, keep_last: int | None = None) -> Path:
    """Writes the engine's state to ``ckpt_dir/<tag>/`` (default tag ``step<N>``); a
    collective: every rank must call it. Returns the checkpoint's directory. Once it
    is committed, unfinished saves' ``.tmp-`` directories are removed and, with
    ``keep_last=K``, every complete checkpoint but the newest K. A save that fails
    raises on every rank, removes what it wrote and leaves ``latest`` as it was."""
    _check_savable(engine)
    tag = _check_tag(tag if tag is not None else f"step{engine.steps}")
    keep_last = _check_keep(keep_last)
    root = Path(ckpt_dir)
    rank, world = engine.rank, engine.world
    nonce = [secrets.token_hex(4) if rank == 0 else None]
    if world > 1:
        _collective(f"saving checkpoint {tag!r} in {root}", dist.broadcast_object_list, nonce, src=0)
    tmp = root / f"{tag}.tmp-{nonce[0]}"
    try:
        _agreed(world, f"saving checkpoint {tag!r} in {root}",
                lambda: tmp.mkdir(parents=True) if rank == 0 else None)
        sd = _state_dict(engine, client_state)
        elementwise = sorted(k for k, v in sd.items() if k.startswith("optim.") and isinstance(v, FlatChunk))
        _agreed(world, f"saving checkpoint {tag!r} in {root}", lambda: _write(engine, sd, tmp))
        names = sorted(p.name for p in tmp.iterdir())  # every rank's files are written
        everyone = _agreed(world, f"checksumming checkpoint {tag!r} in {root}",
                           lambda: {n: _crc(tmp / n) for n in _mine(names, rank, world)})
        crc = {k: v for part in everyone for k, v in part.items()}
        _agreed(world, f"committing checkpoint {tag!r} in {root}",
                lambda: _commit(engine, root, tmp, tag, _marker(engine, tag, elementwise, tmp, crc), keep_last)
                if rank == 0 else None)
    except DcirError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what the failed save wrote: a full disk gets it back
        now = latest(root)
        if now == tag and _step_of(root / tag) == engine.steps:  # rank 0 committed; a peer did not confirm
            raise _error(f"{e.diagnostics[0].message}; the checkpoint was committed: {tag!r} is the latest") from None
        kept = f"{now!r} stays the latest checkpoint" if now else "there is no complete checkpoint yet"
        raise _error(f"{e.diagnostics[0].message}; nothing was saved: {kept}") from None
    return root / tag


def _write(engine, sd: dict, tmp: Path) -> None:
    """This rank's files of the checkpoint: DCP's, and on rank 0 the model's config."""
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=FlatSavePlanner())
    except CheckpointException as e:
        if engine.rank in e.failures and (hint := _disk_hint(tmp)):  # the writer's own error rarely says why
            e = CheckpointException(str(e), {engine.rank: (OSError(f"{_reason(e)} ({hint})"), None)})
        raise e from None
    if os.environ.get(KILL_IN_SAVE):
        os.kill(os.getpid(), signal.SIGKILL)
    config = getattr(engine.model, "config", None)
    if engine.rank == 0 and hasattr(config, "to_json_string"):
        (tmp / "config.json").write_text(config.to_json_string())


def _disk_hint(path: Path) -> str:
    """Why writing under ``path`` may have failed: this process's file-size limit, or a
    full disk; "" when neither holds."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"this process's file-size limit, RLIMIT_FSIZE, is {soft} bytes"
    free = shutil.disk_usage(path).free
    return f"the disk holding {path} has {free} bytes free" if free < (64 << 20) else ""


def _marker(engine, tag: str, elementwise: list[str], tmp: Path, crc: dict[str, int]) -> dict:
    return {"format": FORMAT, "tag": tag, "step": engine.steps, "micro_steps": engine.micro_steps,
            "world_size": engine.world, "zero_stage": engine.config.zero_stage,
            "gradient_accumulation_steps": engine.config.gradient_accumulation_steps,
            "offload": engine.config.offload, "time": time.time(), **_manifest_of_model(engine),
            "elementwise": elementwise, "param_groups": len(engine.optimizer.param_groups),
            "files": {n: [(tmp / n).stat().st_size, crc[n]] for n in sorted(crc)}}


def _commit(engine, root: Path, tmp: Path, tag: str, marker: dict, keep_last: int | None) -> None:
    """Rank 0: the marker, the rename to ``root/tag``, ``latest``; then the cleaning."""
    _write_atomic(tmp / MARKER, json.dumps(marker, indent=1))
    _fsync_dir(tmp)
    final = root / tag
    if final.exists():  # the same tag again: the new one replaces it
        old = tmp.with_name(tmp.name + "-old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _write_atomic(root / LATEST, tag + "\n")
    _fsync_dir(root)
    _clean(root, tag, keep_last)


def _clean(root: Path, newest: str, keep_last: int | None) -> None:
    """After a commit: unfinished saves' leftovers (``.tmp-`` directories and files of
    killed saves), and with ``keep_last`` the complete checkpoints older than the newest
    ``keep_last`` (``newest``, just committed, is always kept)."""
    for d in root.iterdir():
        if ".tmp-" in d.name and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        elif ".tmp-" in d.name:
            d.unlink(missing_ok=True)
    if keep_last is None:
        return
    done = sorted((d for d in root.iterdir() if d.is_dir() and (d / MARKER).is_file() and d.name != newest),
                  key=lambda d: (_step_of(d), d.stat().st_mtime), reverse=True)
    for d in done[keep_last - 1:]:
        shutil.rmtree(d, ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------

def _check_keys(engine, path: Path, marker: dict, meta: dict) -> None:
    """The checkpoint's parameters and buffers against the engine's: one error listing
    every difference."""
    ours = {n: list(s) for n, s in engine.shapes.items()}
    theirs = {n: p["shape"] for n, p in marker["parameters"].items()}
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    shapes = [f"{n}: {theirs[n]} in the checkpoint, {ours[n]} here" for n in sorted(set(ours) & set(theirs))
              if theirs[n] != ours[n]]
    buffers = set(_persistent_buffers(engine.model))
    missing += sorted(buffers - set(marker["buffers"]))
    extra += sorted(set(marker["buffers"]) - buffers)
    absent = [n for n in list(theirs) + marker["buffers"] if n in set(ours) | buffers and n not in meta]
    if not (missing or extra or shapes or absent):
        return
    lines = [f"{path} does not match this model ({type(engine.model).__name__}):"]
    for what, keys in (("missing from the checkpoint", missing), ("in the checkpoint, not in the model", extra),
                       ("with another shape", shapes), ("listed but not stored", absent)):
        if keys:
            lines.append(f"  {len(keys)} {what}: {', '.join(keys[:20])}{' ...' if len(keys) > 20 else ''}")
    raise _error("\n".join(lines))


def _load_dict(engine, meta: dict, marker: dict, in_place: bool) -> dict:
    """What DCP reads into, in this world's layout, for everything the checkpoint holds
    that this engine takes: with ``in_place``, the engine's own shards and optimizer
    state; fresh tensors for the rest (``_apply`` copies those in)."""
    sd: dict = {}
    elementwise = set(marker["elementwise"])

    def plain(key):
        m = meta[key]
        if isinstance(m, BytesStorageMetadata):
            return None
        return torch.empty(m.size, dtype=m.properties.dtype)

    def into(name, tensor, dtype):
        if in_place and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" \
                and tensor.is_contiguous() and tensor.shape == engine.shards[name].shape:
            return _chunk(engine, name, tensor)
        return _empty_chunk(engine, name, dtype)

    for name, shard in engine.shards.items():
        sd[name] = into(name, shard.data, shard.dtype)
        state = engine.optimizer.state.get(shard, {})
        prefix = f"optim.{name}."
        for key in meta:
            if not key.startswith(prefix):
                continue
            if key in elementwise:
                sd[key] = into(name, state.get(key[len(prefix):]), meta[key].properties.dtype)
            else:
                sd[key] = plain(key)
        if f"grad.{name}" in meta and marker["micro_steps"] % marker["gradient_accumulation_steps"]:
            sd[f"grad.{name}"] = _empty_chunk(engine, name, shard.dtype)
    for name in _persistent_buffers(engine.model):
        sd[name] = plain(name)
    for key in ("optim.param_groups", "dcir.engine", "dcir.client_state", "dcir.lr_scheduler", "dcir.loss_scaler",
                f"dcir.rng.{engine.rank}", f"dcir.cuda_rng.{engine.rank}"):
        if key in meta:
            sd[key] = plain(key)
    return sd


def _candidates(ckpt_dir, tag: str | None) -> list[str]:
    """Rank 0: the checkpoint ``tag`` names; with no tag the latest, then every older
    complete one, newest first (to fall back to when the newer are damaged)."""
    first = _resolve(ckpt_dir, tag)
    if tag is not None:
        return [str(first)]
    older = [d for d in Path(ckpt_dir).iterdir()
             if d.is_dir() and ".tmp-" not in d.name and (d / MARKER).is_file() and d.name != first.name]
    return [str(first)] + [str(d) for d in sorted(older, key=lambda d: (_step_of(d), d.stat().st_mtime),
                                                  reverse=True)]


def _choose(engine, ckpt_dir, tag: str | None) -> tuple[Path, dict]:
    """The checkpoint to load and its marker, its files checked by every rank: ``tag``'s,
    or with no tag the newest complete one that is not damaged, saying which newer
    ones were (a job killed while its disk was failing resumes from the one before)."""
    rank, world = engine.rank, engine.world
    found: list = [None]
    if rank == 0:  # every rank tries the same directories (the ones rank 0 finds), or all raise
        try:
            found = [_candidates(ckpt_dir, tag)]
        except DcirError as e:
            found = [("error", e.diagnostics[0].message)]
    if world > 1:
        _collective(f"loading a checkpoint from {ckpt_dir}", dist.broadcast_object_list, found, src=0)
    if isinstance(found[0], tuple):
        raise _error(found[0][1])
    damaged = []
    for path in map(Path, found[0]):
        try:
            marker = _read_marker(path)
        except DcirError as e:
            if tag is not None:
                raise
            damaged.append((path, [e.diagnostics[0].message.removeprefix(f"{path}: ")]))
            continue
        problems = _agree(_verify_files(path, marker, rank, world), world)
        if not problems:
            if damaged and rank == 0:
                log.warning("dcir: %s; loading %s, the newest complete checkpoint that is not",
                            "; ".join(f"{p} is damaged ({', '.join(ps)})" for p, ps in damaged), path)
            return path, marker
        damaged.append((path, problems))
    if len(damaged) == 1:
        raise _error(f"{damaged[0][0]} is damaged; not loading it:\n  " + "\n  ".join(damaged[0][1]))
    raise _error(f"every complete checkpoint in {Path(ckpt_dir)} is damaged; not loading any:\n  "
                 + "\n  ".join(f"{p}: {problem}" for p, ps in damaged for problem in ps))


def load(engine, ckpt_dir, tag: str | None = None):
    """Loads ``ckpt_dir/<tag>`` (default: the latest complete one, or when its files are
    damaged the newest complete one that is not, with a warning) into the engine, at
    this world size, stage and offload setting; a collective. Returns (the
    checkpoint's directory, the ``client_state`` it was saved with). Every check runs
    before the read, which goes into the engine's tensors in place: a read that fails
    half-way leaves the engine refusing to run (``Execution.half_loaded``) until a load
    succeeds."""
    path, marker = _choose(engine, ckpt_dir, tag)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    _check_keys(engine, path, marker, meta)
    mid = marker["micro_steps"] % marker["gradient_accumulation_steps"]
    if mid and marker["gradient_accumulation_steps"] != engine.config.gradient_accumulation_steps:
        raise _error(f"{path} was saved at micro-step {marker['micro_steps']} inside gradient accumulation of "
                     f"{marker['gradient_accumulation_steps']}; this engine accumulates "
                     f"{engine.config.gradient_accumulation_steps}: resume with the same accumulation")
    _check_groups(engine, path, marker.get("param_groups"))
    in_place = marker["format"] >= 2  # format 1 says its groups only in what DCP reads: fresh tensors first
    sd = _load_dict(engine, meta, marker, in_place)
    try:
        dcp.load(sd, storage_reader=DirectReader(path), planner=FlatLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP's, with every rank's failure, is a BaseException
        reason = str(e).strip()[:2000]
        if in_place:
            engine.execution.half_loaded = f"reading {path} failed half-way"  # refused until a load succeeds
            raise _error(f"{path}: reading the checkpoint failed: {reason}\n"
                         + "the engine's parameters and optimizer state are partly overwritten: load a checkpoint before training on or saving") from None  # noqa: E501
        raise _error(f"{path}: reading the checkpoint failed: {reason}") from None
    groups = pickle.loads(sd["optim.param_groups"])
    _check_groups(engine, path, len(groups))
    _apply(engine, sd, groups, mid)  # its Execution.resume lifts a refusal a half-way read left
    return path, pickle.loads(sd["dcir.client_state"])


def _check_groups(engine, path: Path, saved: int | None) -> None:
    """The checkpoint's number of optimizer parameter groups against the optimizer's
    (format 1 says it only in what DCP reads)."""
    if saved is not None and saved != len(engine.optimizer.param_groups):
        raise _error(f"{path} has {saved} optimizer parameter groups; this optimizer has "
                     f"{len(engine.optimizer.param_groups)}")


@torch.no_grad()
def _apply(engine, sd: dict, groups: list, mid: int) -> None:
    """Copies the loaded values into the engine, in place where a tensor exists (the
    offload store's host buffers stay where they are)."""
    def fill(dst: torch.Tensor, name: str, loaded: FlatChunk) -> None:
        local = loaded.local
        flat = dst.view(-1)
        if local.data_ptr() != flat.data_ptr():  # read into a fresh tensor, not in place
            flat[:local.numel()].copy_(local)
        flat[local.numel():].zero_()

    for name, shard in engine.shards.items():
        fill(shard.data, name, sd[name])
        key = f"grad.{name}"
        if mid and key in sd:
            shard.grad = torch.zeros_like(shard)
            fill(shard.grad, name, sd[key])
        else:
            shard.grad = None
        if not shard.requires_grad:
            continue
        state = engine.optimizer.state[shard]
        prefix = f"optim.{name}."
        for k in [k for k in sd if k.startswith(prefix)]:
            key, value = k[len(prefix):], sd[k]
            if isinstance(value, FlatChunk):
                if key not in state or state[key] is None or state[key].shape != shard.shape:
                    state[key] = torch.zeros_like(shard)
                fill(state[key], name, value)
            elif isinstance(value, torch.Tensor):
                if isinstance(state.get(key), torch.Tensor) and state[key].shape == value.shape:
                    state[key].copy_(value)
                else:
                    state[key] = value.clone()
            else:
                state[key] = pickle.loads(value)
    for group, saved in zip(engine.optimizer.param_groups, groups):
        group.update(saved)
    for name, b in _persistent_buffers(engine.model).items():
        b.copy_(sd[name])
    counts = pickle.loads(sd["dcir.engine"])
    engine.execution.resume(counts["steps"], counts["micro_steps"])
    engine.programs.discard_accumulated()  # a trained engine's partial sums (zero1 saves none)
    if f"dcir.rng.{engine.rank}" in sd:
        torch.set_rng_state(sd[f"dcir.rng.{engine.rank}"])
    if f"dcir.cuda_rng.{engine.rank}" in sd and torch.cuda.is_available():
        torch.cuda.set_rng_state(sd[f"dcir.cuda_rng.{engine.rank}"])
    for attr in ("lr_scheduler", "loss_scaler"):
        if getattr(engine, attr, None) is not None and f"dcir.{attr}" in sd:
            getattr(engine, attr).load_state_dict(pickle.loads(sd[f"dcir.{attr}"]))
    if engine.state_store is not None:  # offloaded state to host memory: now, or when the program is captured
        engine.state_store.place_loaded_state(engine.module)


# ---- export ----------------------------------------------------------------------------------

def export(ckpt_dir, out_dir, tag: str | None = None) -> Path:
    """Consolidates a checkpoint into ``out_dir/model.safetensors`` (every parameter
    whole, under each of its names, and the persistent buffers), plus ``config.json``
    when the model had a ``transformers`` config; one process, no process group.
    Returns the safetensors file."""
    from safetensors.torch import save_file  # transformers' dependency, not DCIR's: needed by export alone

    path = _resolve(ckpt_dir, tag)
    marker = _read_marker(path)
    problems = _verify_files(path, marker, 0, 1)
    if problems:
        raise _error(f"{path} is damaged; not exporting it:\n  " + "\n  ".join(problems))
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {}
    for name in list(marker["parameters"]) + marker["buffers"]:
        m = meta[name]
        sd[name] = torch.empty(m.size, dtype=m.properties.dtype)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(sd, storage_reader=DirectReader(path), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for name, p in marker["parameters"].items():
        full = sd[name].reshape(p["shape"])
        for alias in p["aliases"]:
            out[alias] = full.clone()  # safetensors refuses shared storage
    for name in marker["buffers"]:
        out[name] = sd[name].contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").is_file():
        shutil.copyfile(path / "config.json", out_dir / "config.json")
    target = out_dir / "model.safetensors"
    save_file(out, str(target), metadata={"format": "pt", "dcir_step": str(marker["step"])})
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dcir-checkpoint", description="DCIR checkpoints (docs/checkpoint.md).")
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="consolidate a checkpoint into OUT_DIR/model.safetensors (+ config.json)",
                        description="Consolidates a sharded checkpoint, on one process, into OUT_DIR/model.safetensors "
                                    "under the model's own parameter names, and OUT_DIR/config.json when the model "
                                    "was a transformers model (then from_pretrained(OUT_DIR) loads it).")
    ex.add_argument("ckpt_dir", metavar="CKPT_DIR", help="the directory save_checkpoint wrote into")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="where to write model.safetensors (created if missing)")
    ex.add_argument("--tag", default=None, help="the checkpoint to export (default: the latest complete one)")
    ns = ap.parse_args(argv)
    try:
        target = export(ns.ckpt_dir, ns.out_dir, ns.tag)
    except DcirError as e:
        print(e.render(), file=sys.stderr)
        return 1
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
