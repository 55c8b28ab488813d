"""The copy lanes: copies between device and host memory that run beside compute.

One ``CopyLanes`` per device, for the whole process (``lanes``): the optimizer-state
store (``dcir_runtime.offload``) and the activations the ``offload_activations`` pass
hands the backward through host memory copy on the same lanes, so their copies queue
behind each other as the simulator's copy lane has them. On a GPU, host buffers are
pinned and the copies run on two CUDA streams, one per direction (host-to-device
reloads, device-to-host copies home), so a reload and a copy home run at once over a
full-duplex link; each copy is ordered after the compute that produced its source. On
a CPU, "device" and "host" are both RAM, so the copies are real copies between separate
buffers, run by one background thread (torch releases the GIL while it copies), and
only the accounting tells them apart.

A lowered program calls ``offload``, ``reload`` and ``wait`` below for the copies of
activations (``mem.offload`` / ``mem.reload`` marked ``act.offload``, and their
``mem.wait``); ``activation_stats`` says how many bytes of activations are in host
memory now, at their peak, and how many were moved.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


class Pending:
    """A copy in flight: its destination, and what finishes it (a future on a CPU;
    on a GPU the events recorded on its copy stream when it started and ended); no
    ``lanes`` for a copy of nothing (optimizer state not made yet)."""

    __slots__ = ("result", "lanes", "future", "event", "started")

    def __init__(self, result, lanes: CopyLanes | None = None, future: Future | None = None, event=None,
                 started=None):
        self.result, self.lanes, self.future, self.event, self.started = result, lanes, future, event, started


class CopyLanes:
    def __init__(self, device: torch.device):
        self.device = device
        #: host time blocked in wait(): the copies compute did not hide (on a GPU a
        #: device-side wait does not block the host, so there only the waits for copies home)
        self.wait_s = 0.0
        cuda = device.type == "cuda"
        # a copy stream per direction on a GPU; on a CPU both directions share the memory
        # bus, and one thread copies
        self.streams = {d: torch.cuda.Stream(device) for d in ("reload", "offload")} if cuda else None
        self._thread = None if cuda else ThreadPoolExecutor(1, thread_name_prefix="dcir-copy")

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A new host buffer of ``like``'s shape and element type (pinned on a GPU)."""
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.streams is not None)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> Pending:
        """Start copying ``src`` into ``dst`` on the lane of ``direction`` ("reload": to
        the device, "offload": to host memory)."""
        if self.streams is None:
            return Pending(dst, self, self._thread.submit(dst.copy_, src))
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # src is computed
        started, event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            started.record(stream)
            dst.copy_(src, non_blocking=True)
            event.record(stream)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)
        return Pending(dst, self, event=event, started=started)

    def wait(self, pending: Pending):
        """Finish a copy: its destination, usable from here on."""
        begin = time.perf_counter()
        if pending.future is not None:
            pending.future.result()
        elif pending.event is not None:
            if pending.result.is_cuda:
                torch.cuda.current_stream(self.device).wait_event(pending.event)
            else:
                pending.event.synchronize()  # a host copy is complete only when the stream says so
        self.wait_s += time.perf_counter() - begin
        return pending.result


_lanes: dict[torch.device, CopyLanes] = {}
_made = threading.Lock()


def lanes(device: torch.device | str) -> CopyLanes:
    """The process's copy lanes for ``device`` (made at the first call)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _made:
        if device not in _lanes:
            _lanes[device] = CopyLanes(device)
        return _lanes[device]


def wait_s() -> float:
    """Host seconds this process has spent blocked waiting for copies, on every device's lanes."""
    with _made:
        return sum(lane.wait_s for lane in _lanes.values())


# ---- activations: what a lowered graph calls ----------------------------------------------

@dataclass
class ActivationStats:
    host_now: int = 0     # bytes of activations in host memory now
    host_peak: int = 0    # ... at their peak since the process started
    moved: int = 0        # bytes copied either way since the process started


_stats = ActivationStats()
#: a host copy (by id) -> (a weak reference to it, the device its activation came from)
_home: dict[int, tuple[weakref.ref, torch.device]] = {}


def offload(t: torch.Tensor) -> Pending:
    """Start copying activation ``t`` to a new host buffer."""
    lane = lanes(t.device)
    host = lane.host_buffer(t)
    key, nbytes = id(host), host.untyped_storage().nbytes()

    def gone(_, key=key, nbytes=nbytes):
        _home.pop(key, None)
        _stats.host_now -= nbytes

    _home[key] = (weakref.ref(host, gone), t.device)
    _stats.host_now += nbytes
    _stats.host_peak = max(_stats.host_peak, _stats.host_now)
    _stats.moved += nbytes
    return lane.copy(host, t, "offload")


def reload(host: torch.Tensor) -> Pending:
    """Start copying a host copy ``offload`` made back to a new buffer on its device."""
    ref, device = _home.get(id(host), (None, None))
    if ref is None or ref() is not host:
        raise RuntimeError("dcir runtime: mem.reload of an activation no mem.offload copied to host memory")
    dst = torch.empty(host.shape, dtype=host.dtype, device=device)
    _stats.moved += host.untyped_storage().nbytes()
    return lanes(device).copy(dst, host, "reload")


def wait(pending: Pending) -> torch.Tensor:
    """Finish a copy ``offload`` or ``reload`` started; returns its destination."""
    return pending.lanes.wait(pending)


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is a host copy of an activation ``offload`` made (on a CPU, RAM like
    the rest: the profiler leaves it out, as the memory model does)."""
    ref = _home.get(id(t))
    return ref is not None and ref[0]() is t


def finish(pending: Pending) -> None:
    """Wait for a copy of the lanes to end (the profiler times each copy by itself)."""
    if pending.lanes is not None:
        pending.lanes.wait(pending)


def activation_stats() -> ActivationStats:
    """The activations' copies so far (a snapshot)."""
    return ActivationStats(_stats.host_now, _stats.host_peak, _stats.moved)
