#!/usr/bin/env bash
# On a lent GPU machine: the GPU suite and the one-GPU benchmark; the figures go to $OUT.
#
#   bash benchmarks/device-wheels.sh          # here, once: wheels of what the device lacks
#   device run, carrying .device-wheels:  bash benchmarks/device.sh
#
# The device has its own torch (with CUDA) and Python; packages it lacks (lark,
# filecheck, transformers...) come from .device-wheels/ without a network. Writes:
#   $OUT/gpu.txt            nvidia-smi, torch and the native build it made
#   $OUT/gpu_suite.txt      python -m pytest -m gpu tests/test_gpu.py -v
#   $OUT/bench_gpu.txt      benchmarks/bench_train.py --device cuda --world 1 (table),
#   $OUT/bench_gpu.json     ... its figures (step times, x floor, CUDA allocator peaks)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-out}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
missing=$("$py" - <<'PY'
import importlib.util
need = {"lark": "lark", "interegular": "interegular", "networkx": "networkx", "filecheck": "filecheck",
        "hypothesis": "hypothesis", "transformers": "transformers", "tqdm": "tqdm", "ninja": "ninja"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  "$py" -m pip install -q --no-index --find-links .device-wheels $missing || {
    echo "device.sh: cannot install $missing from .device-wheels (run benchmarks/device-wheels.sh and carry it)"; exit 1; }
fi
"$py" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
{ nvidia-smi; "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))";
  "$py" -m dcir_runtime.native_build --check; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt" | tail -3
begin=$SECONDS
"$py" -m pytest -m gpu tests/test_gpu.py -v -s -p no:cacheprovider > "$OUT/gpu_suite.txt" 2>&1
suite=$?
echo "GPU suite: exit $suite in $((SECONDS - begin)) s"; tail -3 "$OUT/gpu_suite.txt"
begin=$SECONDS
"$py" benchmarks/bench_train.py --device cuda --world 1 --systems "${SYSTEMS:-floor,eager,dcir,dcir-optimized,dcir-zero2,dcir-offload,fsdp2}" \
  --rounds "${ROUNDS:-3}" --json "$OUT/bench_gpu.json" --chart "$OUT/bench_gpu.png" > "$OUT/bench_gpu.txt" 2>&1
echo "benchmark: exit $? in $((SECONDS - begin)) s"; tail -14 "$OUT/bench_gpu.txt"
exit $suite
