"""What a compiled stretch of compute costs against its ops run one by one, on this machine.

    python benchmarks/calibrate_fusion.py [--repeats 31] [--threads 1]

The simulator prices a stretch the ``fuse`` pass compiles (``dcir.fusion``) by two
figures of a machine (``[compiler]`` in ``dcir/machines/*.toml``): the fixed cost of
one call into compiled code (``call_s``) and the share of their eager time that the
ops Inductor fuses take (``fused_share``); matmuls keep their eager time (the same
library kernels). This script measures both. It traces the stretches a Llama layer
is cut into (RMSNorm, the rotary embedding, the softmax of the scores, SwiGLU, the
residual adds, each alone and in the combinations a schedule leaves between two
collectives) at a few sizes, to the aten ops DCIR captures, and times each one op
by op (the eager lowering) and compiled by Inductor as the lowering compiles it
(``dcir_lowering.stretches._Compiled``: results made contiguous), the median of
``--repeats`` runs after a warm-up, one thread (as each rank runs). A line through
(eager seconds, compiled seconds), fitted by least squares on relative errors (each
stretch counts alike, small or large), gives ``fused_share`` (its slope) and
``call_s`` (its intercept), printed as a ``[compiler]`` table with every stretch's times.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _stretches(batch: int, seq: int, hidden: int, heads: int):
    """(name, function, example inputs) for the pointwise stretches of one Llama layer."""
    import torch

    d = hidden // heads
    x = torch.randn(batch, seq, hidden)
    w = torch.randn(hidden)
    q = torch.randn(batch, heads, seq, d)
    cos, sin = torch.randn(seq, d), torch.randn(seq, d)
    scores = torch.randn(batch, heads, seq, seq)
    mask = torch.triu(torch.full((seq, seq), float("-inf")), 1)
    gate, up = torch.randn(batch, seq, 4 * hidden), torch.randn(batch, seq, 4 * hidden)

    def rms(x, w):
        v = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(v + 1e-6))

    def rotary(q, cos, sin):
        half = q.shape[-1] // 2
        rot = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rot * sin

    def softmax(s, mask):
        return torch.softmax(s * 0.125 + mask, dim=-1, dtype=torch.float32)

    def swiglu(g, u):
        return torch.nn.functional.silu(g) * u

    def residual_rms(x, y, w):
        h = x + y
        return h, rms(h, w)

    return [("rmsnorm", rms, (x, w)), ("rotary", rotary, (q, cos, sin)), ("softmax", softmax, (scores, mask)),
            ("swiglu", swiglu, (gate, up)), ("residual+rmsnorm", residual_rms, (x, x.clone(), w)),
            ("add", lambda a, b: a + b, (x, x.clone()))]


def _median_s(fn, args, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure(repeats: int) -> list[tuple[str, float, float]]:
    """(stretch, eager seconds, compiled seconds) for every stretch and size."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._inductor.compile_fx import compile_fx

    rows = []
    for batch, seq, hidden, heads in ((1, 64, 256, 4), (4, 128, 256, 8), (4, 128, 768, 12)):
        for name, fn, args in _stretches(batch, seq, hidden, heads):
            gm = make_fx(fn)(*args)  # aten ops, as DCIR captures them

            with torch.no_grad():
                compiled = compile_fx(gm, list(args))

            def run_compiled(*a):
                out = compiled(*a)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                return [t.contiguous() for t in outs]

            with torch.no_grad():
                rows.append((f"{name} {batch}x{seq}x{hidden}", _median_s(gm, args, repeats),
                             _median_s(run_compiled, args, repeats)))
    return rows


def fit(rows) -> tuple[float, float]:
    """(call_s, fused_share): the line compiled = call_s + fused_share * eager that
    minimizes the squared relative errors (each row weighted by 1 / its eager time)."""
    import numpy as np

    eager = np.array([e for _, e, _ in rows])
    compiled = np.array([c for _, _, c in rows])
    a = np.stack([np.ones_like(eager), eager], axis=1) / eager[:, None]
    (call_s, share), *_ = np.linalg.lstsq(a, compiled / eager, rcond=None)
    return max(float(call_s), 0.0), float(share)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=31, help="timed runs per stretch (default 31)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as each rank runs)")
    ns = ap.parse_args(argv)
    import torch

    torch.set_num_threads(ns.threads)
    rows = measure(ns.repeats)
    print(f"{'stretch':<32} {'eager us':>10} {'compiled us':>12} {'ratio':>6}")
    for name, e, c in rows:
        print(f"{name:<32} {e * 1e6:10.1f} {c * 1e6:12.1f} {c / e:6.2f}")
    call_s, share = fit(rows)
    print(f"\n[compiler]\ncall_s = {call_s:.3g}\nfused_share = {share:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
