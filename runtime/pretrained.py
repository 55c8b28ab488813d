"""A pretrained checkpoint read straight into this rank's parameter shards.

``Checkpoint.open(path)`` takes what ``transformers``' ``save_pretrained(dir,
safe_serialization=True)`` writes: ``model.safetensors``, or shards named by
``model.safetensors.index.json``'s ``weight_map`` (the directory, the file or the index
itself). Opening reads the files' headers only, to learn every tensor's name, shape and
dtype; ``check(expected)`` compares them with the model's parameters and persistent
buffers and reports every missing, unexpected and mis-shaped key in one error, before
any tensor data is read, so a bad checkpoint never loads halfway.

``read_shard(name, rank, world, dtype)`` returns the rank's flat shard in the engine's
layout (``dcir.layout.ShardLayout``: the tensor flattened, zero-padded to a multiple
of ``world``, elements ``[rank * chunk, (rank + 1) * chunk)``). It reads only the rows
(slices along the first dimension) that overlap those elements, through safetensors'
``get_slice``, so a rank holds its shard plus at most two partial rows of one tensor at
a time (the whole tensor only when it has so few rows): a model larger than one
process's memory loads shard by shard. safetensors maps the file, so those rows are
pages touched in the page cache; the shard is copied out of them, and nothing returned
keeps the file mapped or changes when the file is rewritten. At most one shard file is
open at a time; ``with Checkpoint.open(p) as ckpt:`` closes it.

    with Checkpoint.open("llama-dir") as ckpt:
        ckpt.check({"model.embed_tokens.weight": ((128, 64), ["model.embed_tokens.weight", "lm_head.weight"]),
                    ...}, optional={"model.rotary_emb.inv_freq"})
        shard = ckpt.read_shard("lm_head.weight", rank, world, torch.float32)
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from torch.utils import swap_tensors

from dcir.diagnostics import DcirError, Diagnostic, Note
from dcir.layout import ShardLayout

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_EXPECTED = f"a .safetensors file, a .safetensors.index.json file, or a directory holding {SINGLE} or {INDEX}"
#: how many names a list in an error shows before "... and N more"
SHOWN = 20


@dataclass(frozen=True)
class Stored:
    """One tensor as a checkpoint's header describes it."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Checkpoint:
    """The tensors of a safetensors checkpoint by name, read whole or as one rank's shard."""

    def __init__(self, path: Path, tensors: dict[str, Stored]):
        self.path = path
        #: every stored tensor by its name, in the checkpoint's order
        self.tensors = tensors
        #: each name ``check`` accepted (every alias of a parameter) -> the name stored
        self._stored_as: dict[str, str] = {}
        self._open: tuple[Path, object] | None = None
        self._stack = ExitStack()

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Checkpoint":
        """The checkpoint at ``path`` (see the module docstring), its headers read."""
        path = Path(path)
        files = _shard_files(path)
        tensors: dict[str, Stored] = {}
        for file, names in files.items():
            for name, stored in _header(file).items():
                if names is None or name in names:
                    tensors[name] = stored
        if any(names is not None for names in files.values()):
            _check_index(path, files, tensors)
        return cls(path, tensors)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the open shard file, if any (reading again reopens it)."""
        self._open = None
        self._stack.close()

    def check(self, expected: Mapping[str, tuple[Sequence[int], Iterable[str]]],
              optional: Iterable[str] = ()) -> None:
        """Raises one error listing every difference between the checkpoint and ``expected``:
        each parameter's (and persistent buffer's) first FQN -> ``(shape, aliases)``.
        A parameter is found under any of its names (``transformers`` saves one name of
        tied weights); one named in ``optional`` (a non-persistent buffer) may be absent.
        Once it passes, ``read_shard`` and ``read`` take any of the names."""
        optional = set(optional)
        stored_as: dict[str, str] = {}
        missing, misshaped = [], []
        for first, (shape, aliases) in expected.items():
            names = list(dict.fromkeys([first, *aliases]))
            present = [n for n in names if n in self.tensors]
            if not present and optional.isdisjoint(names):
                missing.append(" or ".join(names))
            for name in present:
                if self.tensors[name].shape != tuple(shape):
                    misshaped.append(f"{name}: {_shape(self.tensors[name].shape)} in the checkpoint, "
                                     f"{_shape(shape)} in the model")
            stored_as.update({n: present[0] for n in names if present})
        unexpected = [n for n in self.tensors if n not in stored_as]
        if missing or unexpected or misshaped:
            raise _mismatch(self.path, missing, unexpected, misshaped)
        self._stored_as = stored_as

    def read_shard(self, name: str, rank: int, world: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rank ``rank``'s flat shard of ``name`` among ``world`` (``ShardLayout``): its
        elements ``[rank * chunk, (rank + 1) * chunk)`` of the flattened tensor, ``chunk =
        ceil(numel / world)``, zero-padded past the end, as ``dtype`` (default: as
        stored). Reads only the rows those elements lie in."""
        key = self._key(name)
        stored = self.tensors[key]
        if not 0 <= rank < world:
            raise DcirError(Diagnostic(f"rank {rank} is outside a world of {world} (reading {name} from {self.path})"))
        layout = ShardLayout(stored.numel, world)
        part = self._elements(key, stored, *layout.range_of(rank))
        shard = torch.zeros(layout.chunk, dtype=dtype or part.dtype)
        shard[:part.numel()].copy_(part)
        return shard

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (a buffer, say), as ``dtype`` (default: as stored)."""
        key = self._key(name)
        whole = self._handle(self.tensors[key].file).get_tensor(key)  # a view of the mapped file
        return whole.to(dtype or whole.dtype, copy=True)

    def _key(self, name: str) -> str:
        """The stored name of ``name``, itself or, after ``check``, one of its aliases."""
        key = self._stored_as.get(name, name)
        if key not in self.tensors:
            raise DcirError(Diagnostic(
                f"{self.path} holds no tensor named {name} (a tied parameter's other names are known "
                "only after check(expected))"))
        return key

    def _elements(self, key: str, stored: Stored, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``key``, read as the rows they lie
        in (none when the range is empty: the result still has the stored dtype)."""
        handle = self._handle(stored.file)
        if not stored.shape:
            return handle.get_tensor(key).reshape(1)[lo:hi]
        if stored.numel == 0:
            return handle.get_slice(key)[0:0].reshape(-1)
        row = stored.numel // stored.shape[0]
        first, stop = lo // row, -(-hi // row)
        rows = handle.get_slice(key)[first:stop]
        return rows.reshape(-1)[lo - first * row:hi - first * row]

    def _handle(self, file: Path):
        """``file`` opened with safetensors, the one open file (the previous one closed)."""
        if self._open is not None and self._open[0] == file:
            return self._open[1]
        from safetensors import safe_open  # transformers' dependency, not DCIR's: for pretrained weights

        self.close()
        self._open = (file, self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu")))
        return self._open[1]


def _shard_files(path: Path) -> dict[Path, set[str] | None]:
    """Each file of the checkpoint at ``path`` -> the names the index puts in it (None:
    a single file, all of its tensors)."""
    if path.is_dir():
        if (path / SINGLE).is_file():  # transformers' own preference when both are there
            return {path / SINGLE: None}
        if (path / INDEX).is_file():
            return _index(path / INDEX)
        notes = ()
        if (path / "pytorch_model.bin").exists():
            notes = (Note(None, "it holds pytorch_model.bin: only safetensors checkpoints are read "
                                "(save_pretrained(dir, safe_serialization=True) writes one)"),)
        raise DcirError(Diagnostic(f"{path} holds no checkpoint: expected {_EXPECTED}", notes=notes))
    if not path.exists():
        raise DcirError(Diagnostic(f"no checkpoint at {path}: it does not exist; expected {_EXPECTED}"))
    if path.name.endswith(".safetensors.index.json"):
        return _index(path)
    if path.name.endswith(".safetensors"):
        return {path: None}
    raise DcirError(Diagnostic(f"{path} is not a safetensors checkpoint: expected {_EXPECTED}"))


def _index(index: Path) -> dict[Path, set[str]]:
    """The shard files an index's ``weight_map`` names -> the tensors in each; every file
    must exist."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise DcirError(Diagnostic(f"{index} is not a readable safetensors index: {e}")) from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise DcirError(Diagnostic(
            f"{index} has no weight_map: expected a JSON object with \"weight_map\": {{tensor name: shard file}}"))
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(index.parent / file, set()).add(name)
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise DcirError(Diagnostic(
            f"{index} names shard files missing from {index.parent}: {_listed(absent, ', ')}"))
    return files


def _check_index(path: Path, files: dict[Path, set[str] | None], tensors: dict[str, Stored]) -> None:
    """Every name in the index is in the file it points to."""
    lost = [f"{n} (in {f.name})" for f, names in files.items() for n in sorted(names or ()) if n not in tensors]
    if lost:
        raise DcirError(Diagnostic(
            f"{path}: the index maps tensors to shard files that do not hold them: {_listed(lost, ', ')}"))


def _header(file: Path) -> dict[str, Stored]:
    """Every tensor in ``file``'s header (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open  # as in _handle: only pretrained weights need it

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            return {name: Stored(file, tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except (SafetensorError, OSError) as e:
        raise DcirError(Diagnostic(f"{file} is not a readable safetensors file: {e}")) from None


def _mismatch(path: Path, missing: list[str], unexpected: list[str], misshaped: list[str]) -> DcirError:
    """The one error ``check`` raises, a note per kind of problem."""
    counts = [f"{len(missing)} missing", f"{len(unexpected)} unexpected", f"{len(misshaped)} mis-shaped"]
    notes = []
    if missing:
        notes.append(Note(None, "missing from the checkpoint (a tied parameter by each of its names):"
                                + _listed(missing)))
    if unexpected:
        notes.append(Note(None, "in the checkpoint but not in the model:" + _listed(unexpected)))
    if misshaped:
        notes.append(Note(None, "shaped differently:" + _listed(misshaped)))
    return DcirError(Diagnostic(f"{path} does not match the model: {', '.join(counts)} keys", notes=tuple(notes)))


def _listed(items: Sequence[str], sep: str = "\n  ") -> str:
    """The first ``SHOWN`` of ``items`` and a count of the rest, joined by ``sep``; a list
    one per line starts on a line of its own."""
    shown = list(items[:SHOWN]) + ([f"... and {len(items) - SHOWN} more"] if len(items) > SHOWN else [])
    return (sep if sep.startswith("\n") else "") + sep.join(shown)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"



def aliases_of(model: torch.nn.Module) -> dict[str, list[str]]:
    """The first FQN of each distinct parameter -> every FQN it goes by (tied parameters are one)."""
    aliases: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(first.setdefault(id(p), name), []).append(name)
    return aliases


def load_shards(model: torch.nn.Module, path, rank: int, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's flat shard of each of ``model``'s parameters (by first FQN), read from
    the checkpoint at ``path`` after ``check`` has passed; its persistent buffers are set
    in place (a non-persistent one, such as rotary ``inv_freq``, may be absent: the
    model's init computes it)."""
    aliases = aliases_of(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    persistent = [k for k in model.state_dict(keep_vars=True) if k in buffers]
    expected = {n: (tuple(p.shape), aliases[n]) for n, p in params.items()}
    expected.update({n: (tuple(buffers[n].shape), [n]) for n in persistent})
    with Checkpoint.open(path) as ckpt:
        ckpt.check(expected, optional=set(buffers) - set(persistent))
        out = {n: ckpt.read_shard(n, rank, world, p.dtype).to(device) for n, p in params.items()}
        for n in persistent:
            value = ckpt.read(n, buffers[n].dtype).to(device)
            if buffers[n].is_meta:
                swap_tensors(buffers[n], value)
            else:
                buffers[n].copy_(value)
    return out
