"""The GPU suite: the CUDA path of the runtime, run for real on a machine with a GPU.

``python -m pytest -m gpu`` runs it (``benchmarks/device.sh`` does, on a lent GPU
machine, and keeps the figures); without a GPU every test here is skipped with the
reason. What it covers:

* the equivalence cases of ZeRO-1/2/3, the schedule passes, the optimization cycle
  and offload on CUDA tensors, against single-device eager on the same GPU: at world
  1 over NCCL on one GPU (streams, events, pinned copies and the whole program run),
  and at world N over NCCL when N GPUs are visible;
* each collective of the C++ runtime against its definition, over NCCL;
* the profiler's CUDA figures (``prof.cuda_mem`` from the allocator, per-op times);
* offload's two copy streams: a reload and a copy home run at once, and both overlap
  compute on the compute stream.

The C++ runtime's CUDA/NCCL variant is compiled and linked on every CI run, GPU or
not (``.ci/cuda-build``); this suite is what runs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dcir_runtime.launch import launch

HERE = Path(__file__).resolve().parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (torch.cuda.is_available() is False); the CUDA "
                                                   "build itself is checked by .ci/cuda-build")]

#: equivalence cases of tests/dist_worker.py run on the GPU: every ZeRO stage, the
#: passes, the optimization cycle, offload (copy streams, pinned host memory)
CASES = ["mlp", "transformer", "transformer_prefetch_unshard_bucket", "tied_frozen", "hf_llama_optimize",
         "mlp_zero1", "mlp_zero2", "transformer_zero1_accumulate4", "transformer_zero2_accumulate4",
         "mlp_offload", "transformer_offload_accumulate4", "hf_llama_offload_optimize"]

WORLDS = [1] + ([GPUS] if GPUS > 1 else [])
#: cases sized for sharded state: mlp_offload's budget (520 B) is under the state of one
#: whole parameter (1 KiB), which one rank holds unsharded, so it cannot compile at world 1
SHARDED_ONLY = {"mlp_offload"}


def _on_gpus(argv: list[str], world: int, timeout_s: float) -> int:
    return launch([str(HERE / "dist_worker.py"), *argv], world, timeout_s=timeout_s,
                  env={"DCIR_TEST_DEVICE": "cuda"})


@pytest.mark.parametrize("world", WORLDS)
def test_training_on_cuda_matches_eager(tmp_path, world):
    out = tmp_path / "results.json"
    cases = [c for c in CASES if world > 1 or c not in SHARDED_ONLY]
    assert _on_gpus(["equivalence", str(out), *cases], world, timeout_s=900) == 0
    results = json.loads(out.read_text())
    worst = {name: r["max_rel_err"] for name, r in results.items()}
    print(json.dumps(worst, indent=1))
    assert all(err <= 1e-5 for err in worst.values()), worst


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_over_nccl_match_their_definition(world):
    assert _on_gpus(["ops", "process_group"], world, timeout_s=300) == 0


def profile_on_cuda() -> None:
    """The optimization cycle on one GPU (its own process: a NCCL group of one): every
    op of the profiled program has a time, and ops that allocate on the GPU carry the
    CUDA allocator's figure."""
    import dcir
    from models import mlp, squared

    torch.manual_seed(0)
    engine = dcir.initialize(mlp().cuda(), config={"optimize": {"passes": ["prefetch"], "profile_at": [1]}},
                             loss_fn=squared)
    x = torch.randn(4, 8, device="cuda")
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
    profiled = engine.profiled_ir()
    assert profiled is not None, "no step was profiled"
    ops = [op for f in profiled.functions.values() for op in f.ops]
    assert all(isinstance(op.attrs.get("prof.time_us"), float) for op in ops), "an op has no time"
    assert any(op.attrs.get("prof.cuda_mem", 0) > 0 for op in ops), "no op has the CUDA allocator's figure"
    print("profiled on cuda: ok")


def test_profiler_takes_cuda_figures():
    import subprocess
    proc = subprocess.run([sys.executable, __file__, "profile"], capture_output=True, text=True, timeout=300,
                          cwd=HERE)
    assert proc.returncode == 0 and "profiled on cuda: ok" in proc.stdout, proc.stdout + proc.stderr


def test_offload_copies_run_both_ways_at_once_and_overlap_compute():
    """Two copy streams: a copy home (device to host) and a reload (host to device)
    issued back to back both start before either ends, and compute queued after them
    on the compute stream starts before they end."""
    from dcir_runtime.offload import StateStore

    device = torch.device("cuda")
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    store = StateStore(torch.optim.AdamW([param]), {"p": param}, device)
    assert store.lanes.streams["reload"] != store.lanes.streams["offload"]
    n = 64 * 2**20  # 256 MB each way: long enough to see the overlap
    on_device = torch.randn(n, device=device)
    home = store.wait(store.offload(torch.randn(n, device=device)))  # a pinned host buffer to reload from
    a = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()
    out = store.offload(on_device)
    back = store.reload(home)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        a = a @ a / 2048
    end.record()
    store.wait(out)
    store.wait(back)
    torch.cuda.synchronize()
    # a reload that waited for the copy home would start after it ended
    assert back.started.elapsed_time(out.event) > 0, "the reload waited for the copy home"
    assert out.started.elapsed_time(back.event) > 0, "the copy home waited for the reload"
    assert begin.elapsed_time(out.event) > 0 and begin.elapsed_time(back.event) > 0, \
        "the compute started only after the copies ended"
    assert out.result.is_pinned() and back.result.is_cuda


if __name__ == "__main__":
    if sys.argv[1:] == ["profile"]:
        profile_on_cuda()
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-v"]))
