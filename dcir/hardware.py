"""Fitting a machine's description to a profile (``fit``; ``python -m dcir.hardware``); the
descriptions themselves are read and written by ``dcir.machine`` (``load``, ``dump``), re-exported here."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from dcir import ops as registry
from dcir.cost import TIME, calibrate, is_host_copy, op_flops, touched_bytes
from dcir.diagnostics import DcirError
from dcir.ir import Module
from dcir.machine import MACHINES, HardwareError, Machine, dump, load, shipped
from dcir.memory import device_bytes
from dcir.parser import parse

__all__ = ["MACHINES", "HardwareError", "Machine", "dump", "fit", "load", "main", "shipped"]


def fit(module: Module, name: str, base: Machine | None = None) -> Machine:
    """A description of the machine a profiled ``module`` ran on: links by ``calibrate``,
    the device from its profiled aten ops (FLOP/s from the matmuls, streaming bandwidth
    from the ops that do no arithmetic and move at least 64 KiB, dispatch from the median
    op that moves under 4 KiB) and host copies from the profiled copies."""
    base = calibrate(module, base or Machine(world_size=module.world_size))
    timed = [(op, op.attrs[TIME] * 1e-6) for _, op in module.ops()
             if isinstance(op.attrs.get(TIME), (int, float)) and op.attrs[TIME] > 0]
    aten = [(op, t) for op, t in timed if registry.has_trait(op, registry.COMPUTE)]
    small = sorted(t for op, t in aten if touched_bytes(op) < 4096)
    dispatch = small[len(small) // 2] if small else base.dispatch_s
    mm = [(op_flops(op), t) for op, t in aten if op_flops(op) > 0]
    stream = [(touched_bytes(op), t) for op, t in aten if op_flops(op) == 0 and touched_bytes(op) >= 65536]
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
    ap = argparse.ArgumentParser(prog="python -m dcir.hardware", description=main.__doc__.split("\n")[0])
    ap.add_argument("profiled", help="a module whose ops carry prof.time_us (bench_train_logs/*.dcir)")
    ap.add_argument("--name", required=True, help="the machine's name")
    ap.add_argument("-o", "--output", default="-", help="where to write the description (default: stdout)")
    ns = ap.parse_args(argv)
    try:
        module = parse(Path(ns.profiled).read_text(), ns.profiled)
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
