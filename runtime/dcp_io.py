"""DCIR's side of torch.distributed.checkpoint (DCP): the engine's flat shards as DCP's
planners see them, and DCP's ``FileSystemReader`` with the reads copied straight from
the file into their targets.

``FlatChunk`` is this rank's range of a parameter's flat elements: what a save writes
and a load reads into, in place. ``FlatSavePlanner`` and ``FlatLoadPlanner`` (DCP's
default planners otherwise) plan its writes and reads from that range, exactly as for a
DTensor ``Shard(0)`` of the flat tensor (the checkpoint's metadata is the same), so DCP
reshards on load, without building a DTensor per shard: torch computes each of a
DTensor's offsets with a tensor of the shard's size, a fifth of a load's time here and
up to a third of a first save's.

DCP stores each tensor chunk as a ``torch.save`` archive and reads it back with
``torch.load`` into a new tensor, then copies that into the target: per chunk an
unpickling (about 0.3 ms on this machine) and, for a large one, fresh pages and a
second copy. DCIR's parameters and elementwise optimizer state are 1-D chunks (and the
optimizer's steps 0-D), so the bytes of a requested range lie contiguously in the
archive's one storage record:
``DirectReader`` finds that record with torch's own archive reader and ``readinto``
the target's memory, nothing in between (about 10x less time per small chunk, 3x per
large one). Anything else (bytes, n-D tensors, another dtype, a target that is not a
contiguous CPU tensor, transformed or unexpected archives) goes to DCP's own path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import sys

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

#: the one storage record of a chunk ``torch.save`` wrote
_RECORD = "data/0"


@dataclasses.dataclass
class FlatChunk:
    """Elements ``[offset, offset + local.numel())`` of a flat tensor of ``numel``
    elements, held in ``local`` (1-D, contiguous): what a save writes, and a load
    fills in place."""

    local: torch.Tensor
    offset: int
    numel: int

    def storage(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=self.local.size())


class FlatSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, for a flat state dict (no nesting) whose
    ``FlatChunk`` values are written as the shards of their flat tensors (the rest as
    DCP plans them; replicated chunks, HSDP's, are written once)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict: dict, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self.chunks = {k: v for k, v in state_dict.items() if isinstance(v, FlatChunk)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in self.chunks}, storage_meta,
                               is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        mine = [WriteItem(index=MetadataIndex(fqn, torch.Size([c.offset])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c.storage(), size=torch.Size([c.numel]),
                                                      properties=TensorProperties.create_from_tensor(c.local)))
                for fqn, c in self.chunks.items()]
        self.plan = dataclasses.replace(plan, items=plan.items + mine)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        chunk = self.chunks.get(index.fqn)
        return chunk.local if chunk is not None else super().lookup_object(index)


class FlatLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, for a flat state dict (no nesting) whose
    ``FlatChunk`` values are planned from their ranges (the rest as DCP plans them)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.target = state_dict  # where loaded bytes go back to, by key
        self.chunks = {k: v for k, v in state_dict.items() if isinstance(v, FlatChunk)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in self.chunks}, metadata,
                               is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.target[read_item.dest_index.fqn] = torch.load(value, weights_only=False)  # as DCP's own planner does

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        known = self.metadata.state_dict_metadata
        mine = [item for fqn, c in self.chunks.items()
                for item in create_read_items_for_chunk_list(fqn, known[fqn], [c.storage()])]
        return dataclasses.replace(plan, items=plan.items + mine)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        chunk = self.chunks.get(index.fqn)
        return chunk.local if chunk is not None else super().lookup_tensor(index)


class _Window(io.RawIOBase):
    """``length`` bytes of the open file ``f`` from ``offset``, as a file of their own
    (what torch's archive reader reads one chunk's archive through)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class DirectReader(FileSystemReader):
    """A ``FileSystemReader`` whose 1-D tensor reads go straight into their targets."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rest: list[ReadItem] = []
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.TENSOR and len(req.lengths) <= 1 and not info.transform_descriptors:
                per_file.setdefault(info.relative_path, []).append(req)
            else:
                rest.append(req)
        for relative_path, reqs in per_file.items():
            with open(self.fs.concat_path(self.path, relative_path), "rb", buffering=0) as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    if not self._direct(f, req, planner):
                        rest.append(req)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _direct(self, f, req: ReadItem, planner: LoadPlanner) -> bool:
        """Reads ``req`` (a range of a 1-D chunk, or a 0-D tensor) from its archive in
        ``f`` into its target; False (nothing read) where the archive or the target is
        not what the direct path takes."""
        info = self.storage_data[req.storage_index]
        md = planner.metadata.state_dict_metadata.get(req.storage_index.fqn)
        target = planner.resolve_tensor(req).detach()
        start, count = (req.storage_offsets[0], req.lengths[0]) if req.lengths else (0, 1)
        if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != target.dtype \
                or target.device.type != "cpu" or not target.is_contiguous() or target.numel() != count:
            return False
        try:  # torch's archive reader (a private binding): one it cannot parse goes to DCP's path and its error
            archive = torch._C.PyTorchFileReader(_Window(f, info.offset, info.length))
            records = archive.get_all_records()
            order = archive.get_record("byteorder") if "byteorder" in records else b"little"  # absent: torch's default
            record_size, record_offset = archive.get_record_size(_RECORD), archive.get_record_offset(_RECORD)
        except (RuntimeError, AttributeError, TypeError):
            return False
        size = target.element_size()
        at = req.storage_index.offset or torch.Size([0] * len(md.size))
        stored = next((c.sizes.numel() for c in md.chunks if c.offsets == at), None)
        if [r for r in records if r.startswith("data/")] != [_RECORD] or order != sys.byteorder.encode() \
                or stored is None or record_size != stored * size or start + count > stored:
            return False  # DCP writes a chunk's storage alone (no offset into a larger one): anything else is not ours
        if count == 0:
            planner.commit_tensor(req, target)
            return True
        f.seek(info.offset + record_offset + start * size)
        # the target's bytes by address: a numpy view would make its storage unresizable (offload frees by resizing)
        into = memoryview((ctypes.c_char * (count * size)).from_address(target.data_ptr())).cast("B")
        got = 0
        while got < len(into) and (n := f.readinto(into[got:])):
            got += n
        if got != len(into):
            raise OSError(f"{info.relative_path}: {got} of {len(into)} bytes at offset {info.offset} could be read")
        planner.commit_tensor(req, target)
        return True
