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
#   $OUT/bench_gpu_logs.tgz ... each run's raw figures and output (bench_train_logs/)
#
# A lent device has 15 minutes in all: one round of the seven systems took ~190 s on an
# H100 (each run starts its own processes), the GPU suite ~60 s, the native build ~15 s;
# hence one round by default (ROUNDS=3 where there is time).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-out}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
missing=$("$py" - <<'PY'
import importlib.util
need = {"lark": "lark", "interegular": "interegular", "networkx": "networkx", "crc32c": "crc32c", "filecheck": "filecheck",
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
work=$(mktemp -d)  # the runs' logs are many files: they come back as one archive
"$py" benchmarks/bench_train.py --device cuda --world 1 --systems "${SYSTEMS:-floor,eager,dcir,dcir-optimized,dcir-zero2,dcir-offload,fsdp2}" \
  --rounds "${ROUNDS:-1}" --json "$work/bench_gpu.json" --chart "$OUT/bench_gpu.png" > "$OUT/bench_gpu.txt" 2>&1
echo "benchmark: exit $? in $((SECONDS - begin)) s"; tail -14 "$OUT/bench_gpu.txt"
cp "$work/bench_gpu.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/bench_gpu_logs.tgz" -C "$work" bench_train_logs 2>/dev/null
exit $suite
