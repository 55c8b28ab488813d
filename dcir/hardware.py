"""Hardware descriptions: a machine in a TOML file, read into a ``cost.Machine``.

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
from dataclasses import fields, replace
from pathlib import Path

from dcir import ops as registry
from dcir.cost import TIME, Machine, _flops, _touched_bytes, calibrate, is_host_copy
from dcir.ir import Module
from dcir.memory import device_bytes, parse_bytes

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


def fit(module: Module, name: str, base: Machine | None = None) -> Machine:
    """A description of the machine a profiled ``module`` ran on: links by ``calibrate``,
    the device from its profiled aten ops (FLOP/s from the matmuls, streaming bandwidth
    from the ops that do no arithmetic and move at least 64 KiB, dispatch from the median
    op that moves under 4 KiB) and host copies from the profiled copies."""
    base = calibrate(module, base or Machine(world_size=module.world_size))
    timed = [(op, op.attrs[TIME] * 1e-6) for _, op in module.ops()
             if isinstance(op.attrs.get(TIME), (int, float)) and op.attrs[TIME] > 0]
    aten = [(op, t) for op, t in timed if registry.has_trait(op, registry.COMPUTE)]
    small = sorted(t for op, t in aten if _touched_bytes(op) < 4096)
    dispatch = small[len(small) // 2] if small else base.dispatch_s
    mm = [(_flops(op), t) for op, t in aten if _flops(op) > 0]
    stream = [(_touched_bytes(op), t) for op, t in aten if _flops(op) == 0 and _touched_bytes(op) >= 65536]
    copies = [(sum(device_bytes(r) or device_bytes(v) for v in op.operands for r in op.results), t)
              for op, t in timed if is_host_copy(op)]

    def rate(pts, default):
        work, secs = sum(w for w, _ in pts), sum(max(t - dispatch, 1e-9) for _, t in pts)
        return work / secs if pts and work > 0 else default

    return replace(base, name=name, ranks_per_node=module.world_size or base.ranks_per_node, dispatch_s=dispatch,
                   flops=rate(mm, base.flops), mem_bw=rate(stream, base.mem_bw), copy_bw=rate(copies, base.copy_bw))


def main(argv: list[str] | None = None) -> int:
    """``python -m dcir.hardware PROFILED.dcir --name NAME [-o OUT.toml]``: describe the
    machine a profiled module ran on (``fit``)."""
    import argparse
    import sys

    import dcir
    from dcir.diagnostics import DcirError

    ap = argparse.ArgumentParser(prog="python -m dcir.hardware", description=main.__doc__.split("\n")[0])
    ap.add_argument("profiled", help="a module whose ops carry prof.time_us (bench_train_logs/*.dcir)")
    ap.add_argument("--name", required=True, help="the machine's name")
    ap.add_argument("-o", "--output", default="-", help="where to write the description (default: stdout)")
    ns = ap.parse_args(argv)
    try:
        module = dcir.parse(Path(ns.profiled).read_text(), ns.profiled)
    except OSError as e:
        sys.stderr.write(f"cannot read {ns.profiled}: {e.strerror}\n")
        return 2
    except DcirError as e:
        sys.stderr.write(e.render() + "\n")
        return 1
    text = dump(fit(module, ns.name), f"fitted by `python -m dcir.hardware` to the profile in {Path(ns.profiled).name}")
    if ns.output == "-":
        sys.stdout.write(text)
    else:
        Path(ns.output).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
