#!/usr/bin/env bash
# Wheels for the GPU device (Python 3.12, x86_64, no network) of the packages DCIR and
# its GPU suite need beyond torch, into .device-wheels/ (gitignored); benchmarks/device.sh
# installs the ones the device lacks from there.
set -euo pipefail
cd "$(dirname "$0")/.."
pip download -q --dest .device-wheels --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  'lark>=1.2' interegular 'networkx>=3.0' 'crc32c>=2.3' 'filecheck>=1.0' 'hypothesis>=6' 'transformers>=4.45' \
  'tqdm>=4.60' ninja
du -sh .device-wheels
