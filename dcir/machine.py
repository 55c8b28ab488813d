"""Machines: what the cost model needs of one device and of the links between devices
(``Machine``), and the descriptions of machines in TOML files, read into one (``load``).

A description says what the cost model needs of one device and of the links between
devices (``docs/simulator.md`` explains every key and how to add a machine)::

    name = "h100-ib400"
    world_size = 32              # ranks the program runs on

    [device]
    flops = 989e12               # FLOP/s the compute reaches (multiply-adds count 2)
    mem_bw = 3.35e12             # bytes/s a memory-bound op streams
    memory = "80GiB"             # device memory per rank
    dispatch_s = 4e-6            # host cost of one op
    copy_bw = 55e9               # bytes/s of a host copy (PCIe)

    [links]
    ranks_per_node = 8
    intra_bw = 370e9             # bytes/s each rank sends to its ring neighbour in a node
    intra_latency_s = 3.4e-6     # one ring step within a node
    inter_bw = 48e9              # bytes/s each rank sends across nodes (its NIC)
    inter_latency_s = 9.6e-6     # one ring step across nodes
    overlap_share = 0            # share of speed compute and a transfer lose beside each other

    [compiler]
    call_s = 2.5e-6              # host cost of one call into a compiled stretch (dcir.fusion)
    fused_share = 0.6            # share of their eager time the ops a compiled stretch fuses take

Shipped descriptions live in ``dcir/machines/``; ``load`` takes one of their names
(``"h100-ib400"``) or a path.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from dcir.memory import parse_bytes


@dataclass(frozen=True)
class Machine:
    """A machine as the cost model sees it: one device (a rank) and the links between ranks.
    The defaults are one CPU core with gloo over loopback; ``dcir/machines/*.toml`` holds
    described machines (``load``)."""

    flops: float = 2.0e10          # multiply-adds count 2
    mem_bw: float = 5.0e9          # bytes/s a compute op streams
    dispatch_s: float = 8e-6       # host cost of one op
    copy_bw: float = 5.0e9         # bytes/s a host copy moves (one core's memcpy; PCIe on a GPU)
    link_latency_s: float = 1.5e-4  # one ring step within a node
    link_bw: float = 5.0e8         # bytes/s each rank sends to the next within a node
    inter_latency_s: float = 1.5e-4  # one ring step that crosses nodes
    inter_bw: float = 5.0e8        # bytes/s each rank sends across nodes (its NIC)
    ranks_per_node: int = 1 << 20  # devices one node holds (default: every rank in one node)
    #: the share of its speed compute loses while a transfer runs beside it, and the transfer
    #: too (``dcir.sim``): on a CPU whose cores also run the process group's copies (gloo over
    #: loopback), about half; 0 where transfers take no compute core (NCCL on a GPU)
    overlap_share: float = 0.0
    #: the ranks' own threads move a transfer's bytes: its start copies in (its launch), its
    #: first wait copies out (the rest of its time), and nothing moves in between (the
    #: shared-memory transport, ``dcir_runtime.transport``; a profile says so: ``prof.transport``)
    transfers_on_host: bool = False
    #: a compiled stretch of compute (``dcir.fusion``): the host cost of one call into it,
    #: and the share of their eager time the ops it fuses take (``benchmarks/calibrate_fusion.py``)
    compiled_call_s: float = 2.5e-6
    fused_share: float = 0.6
    world_size: int | None = None  # ranks, when the collective's types do not say
    #: the mesh the ranks form, ((dimension, size), ...) as the module declares it
    #: (``dcir/mesh.py``): a collective over one of its dimensions spans the nodes its
    #: group's ranks are on (``ranks_per_node`` consecutive ranks to a node); () without one
    mesh: tuple = ()
    memory: int | None = None      # bytes of device memory (none: not described)
    name: str = "default"
    use_profile: bool = True       # profiled op times override the model (a description: no)

    def collective_s(self, kind: str, full_bytes: int, n: int, nodes: int | None = None) -> float:
        """Seconds of one ring collective of ``kind`` ("all_gather", "reduce_scatter",
        "all_reduce") over ``n`` ranks on ``nodes`` nodes (None: ``n`` consecutive ranks,
        ``ranks_per_node`` to a node), of a tensor of ``full_bytes`` (gathered or reduced).
        An "all_to_all" of ``full_bytes`` sends each rank's ``(n - 1) / n`` of them in
        ``n - 1`` steps, as a reduce-scatter does."""
        if n <= 1:
            return 0.0
        passes = 2 if kind == "all_reduce" else 1
        steps = passes * (n - 1)
        nodes = -(-n // self.ranks_per_node) if nodes is None else nodes
        inter_steps = passes * (nodes - 1)
        bw = self.link_bw if nodes == 1 else min(self.link_bw, self.inter_bw)
        latency = (steps - inter_steps) * self.link_latency_s + inter_steps * self.inter_latency_s
        return latency + full_bytes * steps / n / bw


MACHINES = Path(__file__).parent / "machines"

#: (table, key) in the file -> the Machine field it sets
_KEYS = {
    ("device", "flops"): "flops", ("device", "mem_bw"): "mem_bw", ("device", "memory"): "memory",
    ("device", "dispatch_s"): "dispatch_s", ("device", "copy_bw"): "copy_bw",
    ("links", "ranks_per_node"): "ranks_per_node", ("links", "intra_bw"): "link_bw",
    ("links", "intra_latency_s"): "link_latency_s", ("links", "inter_bw"): "inter_bw",
    ("links", "inter_latency_s"): "inter_latency_s", ("links", "overlap_share"): "overlap_share",
    ("compiler", "call_s"): "compiled_call_s", ("compiler", "fused_share"): "fused_share",
    ("", "name"): "name", ("", "world_size"): "world_size",
}


class HardwareError(ValueError):
    """A description that cannot be read: says the file and the key."""


def shipped() -> list[str]:
    """Names of the descriptions that come with DCIR."""
    return sorted(p.stem for p in MACHINES.glob("*.toml"))


def _path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        return p
    return MACHINES / f"{name_or_path}.toml"


def load(name_or_path: str | Path) -> Machine:
    """The machine a description holds; unknown keys and bad values are errors that
    name the file and the key."""
    path = _path(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise HardwareError(f"cannot read hardware description {path}: {e.strerror} "
                            f"(shipped: {', '.join(shipped())})") from None
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{path}: not valid TOML: {e}") from None
    values: dict = {}
    for table, body in data.items():
        items = body.items() if isinstance(body, dict) else [(table, body)]
        prefix = table if isinstance(body, dict) else ""
        for key, value in items:
            field = _KEYS.get((prefix, key))
            if field is None:
                known = ", ".join(f"{t}.{k}" if t else k for t, k in _KEYS)
                raise HardwareError(f"{path}: unknown key '{prefix + '.' if prefix else ''}{key}'; keys are: {known}")
            values[field] = _value(path, field, value)
    values.setdefault("name", path.stem)
    return Machine(**values, use_profile=False)


def _value(path: Path, field: str, value):
    kind = {f.name: f.type for f in fields(Machine)}[field]
    if field == "memory":
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise HardwareError(f"{path}: device.memory: {e}") from None
    if field == "name":
        return str(value)
    if field == "compiled_call_s" and not isinstance(value, bool) and isinstance(value, (int, float)):
        if value < 0:
            raise HardwareError(f"{path}: 'compiler.call_s' must be at least 0 seconds, got {value!r}")
        return float(value)
    if field == "overlap_share" and not isinstance(value, bool) and isinstance(value, (int, float)):
        if not 0 <= value < 1:
            raise HardwareError(f"{path}: 'overlap_share' must be at least 0 and below 1, got {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise HardwareError(f"{path}: '{field}' must be a positive number, got {value!r}")
    return int(value) if "int" in str(kind) else float(value)


def dump(machine: Machine, comment: str = "") -> str:
    """``machine`` as a description (what ``dcir-sim --calibrate`` writes)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [f'name = "{machine.name}"']
    if machine.world_size:
        lines.append(f"world_size = {machine.world_size}")
    for table in ("device", "links", "compiler"):
        lines.append(f"\n[{table}]")
        for (t, key), field in _KEYS.items():
            value = getattr(machine, field)
            if t != table or value is None:
                continue
            text = f'"{value}B"' if field == "memory" else f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
