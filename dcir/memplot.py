"""The memory picture: live bytes over the op sequence of every function, drawn.

``dcir-opt file.dcir --memory-plot out.png`` draws, for each function of the module,
the memory model's bytes live while each op runs (``dcir.memory``), stacked by what
the storage holds, with the budget line (``--budget``, when given) and the peak op
labelled. The categories follow the storage's first producer:

* parameters: gathered parameter copies (what an all_gather fills, and the
  ``unshard`` buffers held between calls);
* gradients: storage handed to ``grad.set`` or reduced across ranks (a full
  gradient before its reduce_scatter, the shard after), and ``zero1``'s accumulators;
* optimizer state: state reloaded from host memory (``mem.reload``);
* saved activations: what ``@forward`` hands to the backward (``{saved}``), in both;
* offloaded activations: the device copies of activations handed over through host
  memory (``act.offload``): in the forward until their copy out is done, in the
  backward from their reload on;
* recomputed: what an op marked ``act.recompute`` rebuilt in the backward;
* temporaries: everything else.

matplotlib is an optional dependency (``pip install 'dcir[plot]'``).
"""

from __future__ import annotations

from pathlib import Path

from dcir import ops as registry
from dcir import signature
from dcir.activations import OFFLOAD, RECOMPUTE
from dcir.buffers import GRAD_ACC_OF, UNSHARD_OF
from dcir.ir import Function, Module, Op, Value
from dcir.memory import storage_bases, timelines

CATEGORIES = ("parameters", "gradients", "optimizer state", "saved activations", "offloaded activations",
              "recomputed", "temporaries")
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868",
          "saved activations": "#c44e52", "offloaded activations": "#da8bc3", "recomputed": "#8172b3",
          "temporaries": "#937860"}


class PlotError(RuntimeError):
    """The picture cannot be drawn (matplotlib missing)."""


def _category(v: Value, graded: set[Value], saved: set[Value]) -> str:
    op = v.owner if isinstance(v.owner, Op) else None
    if v in graded:
        return "gradients"
    if v in saved:
        return "saved activations"
    if OFFLOAD in getattr(op, "attrs", ()) or any(OFFLOAD in u.attrs for u, _ in v.uses if isinstance(u, Op)):
        return "offloaded activations"  # reloaded, or leaving for host memory
    if op is None:
        return "temporaries"
    if registry.has_trait(op, registry.HOST_COPY):  # state copied back from host: the optimizer's
        return "optimizer state"
    if registry.has_trait(op, registry.COLLECTIVE):  # an all-to-all exchanges a quantized reduction's rows
        reduces = registry.has_trait(op, registry.REDUCES) or registry.has_trait(op, registry.EXCHANGES)
        return "gradients" if reduces else "parameters"
    return "recomputed" if RECOMPUTE in op.attrs else "temporaries"


def _saved(func: Function, own: dict[Value, Value]) -> set[Value]:
    """The storages of the activations ``func`` hands over or is handed (``{saved}``)."""
    values = signature.results(func, signature.SAVED) + signature.args(func, signature.SAVED)
    return {own.get(v, v) for v in values}


def split(module: Module, lines: dict | None = None) -> dict[str, dict[str, list[int]]]:
    """Per function, per category, the bytes live while each op runs: the memory model's
    storages (``Timeline.storage``; ``lines``: its ``timelines(module)`` when the caller
    has them) sorted by what they hold; they add up to its ``during``."""
    lines = lines or timelines(module)
    held = {c: 0 for c in CATEGORIES}
    for d in module.decls.values():
        if UNSHARD_OF in d.attrs:
            held["parameters"] += d.full_type.nbytes
        if GRAD_ACC_OF in d.attrs:
            held["gradients"] += d.full_type.nbytes
    out = {}
    for name, func in module.functions.items():
        t = lines[name]
        own = storage_bases(func)
        graded = set()
        for op in func.ops:
            if registry.has_trait(op, registry.GRADIENT) or (
                    registry.has_trait(op, registry.REDUCES) and registry.has_trait(op, registry.COLLECTIVE)):
                graded.update(own.get(v, v) for v in op.operands)
        n = len(func.ops)
        series = {c: [held[c]] * n for c in CATEGORIES}
        saved = _saved(func, own)
        for v, (nbytes, lo, hi) in t.storage.items():
            cat = _category(v, graded, saved)
            for i in range(max(lo, 0), hi + 1):
                series[cat][i] += nbytes
        out[name] = series
    return out


def plot(module: Module, path: str | Path, budget: int | None = None, title: str = "") -> Path:
    """Draw the picture of ``module`` into ``path`` (PNG, or any format matplotlib knows
    by the suffix); one panel per function."""
    try:  # matplotlib is optional (the plot extra) and slow to import: only when a picture is asked for
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after the backend is chosen: no display needed
    except ImportError:
        raise PlotError("--memory-plot needs matplotlib, an optional dependency: pip install 'dcir[plot]'") from None
    lines = timelines(module)
    series = split(module)
    names = [n for n in module.functions if module.functions[n].ops]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 3.2 * len(names)), squeeze=False)
    mib = 2**20
    for ax, name in zip(axes[:, 0], names):
        t = lines[name]
        xs = range(len(t.during) + 1)  # op i spans [i, i + 1): the last one is drawn too

        def steps(values: list[int]) -> list[float]:
            return [b / mib for b in [*values, *values[-1:]]]

        ax.stackplot(xs, *[steps(series[name][c]) for c in CATEGORIES], labels=CATEGORIES,
                     colors=[COLORS[c] for c in CATEGORIES], alpha=0.85, step="post")
        ax.plot(xs, steps(t.during), color="black", linewidth=0.8, drawstyle="steps-post", label="live bytes (model)")
        if budget:
            ax.axhline(budget / mib, color="red", linestyle="--", linewidth=1, label="budget")
        peak = t.peak_op
        if peak is not None:
            op = module.functions[name].ops[peak]
            label = f"peak {t.during[peak] / mib:.2f} MiB at op {peak}: {op.name}"
            ax.annotate(label, (peak + 0.5, t.during[peak] / mib), xytext=(0.02, 0.9), textcoords="axes fraction",
                        arrowprops={"arrowstyle": "->", "color": "black"}, fontsize=8)
        ax.set_title(f"@{name}", loc="left", fontsize=10)
        ax.set_ylabel("MiB live")
        ax.set_xlim(0, max(len(t.during), 1))
        ax.set_ylim(bottom=0)
    axes[-1, 0].set_xlabel("op (schedule order)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
