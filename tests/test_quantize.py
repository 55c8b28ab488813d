"""Quantized parameter gathers and gradient reductions (ZeRO++'s qwZ and qgZ, the
``quantize`` pass, the config's ``zero_quantized_weights`` and
``zero_quantized_gradients``): a Llama trained 50 AdamW steps with int8 gathers, and with
int8 gathers and reductions, against the same run in fp32, on 2 ranks
(``dist_worker.quantized``)."""

from __future__ import annotations

import json

import pytest

from dcir.diagnostics import DcirError
from dcir_runtime import Config, native
from dcir_runtime.launch import launch
from test_runtime import WORKER

#: the most a step's loss may differ from fp32's, relative (measured over 50 steps: 0.44% with int8
#: gathers, 0.33% with int8 gathers and reductions)
LOSS_TOLERANCE = 0.01


@pytest.fixture(scope="module", autouse=True)
def built():
    native.load()  # build once here, before the ranks start and load it


def test_int8_collectives_train_a_llama_like_fp32_on_a_quarter_of_the_bytes(tmp_path, capfd):
    out = tmp_path / "quantized.json"
    code = launch([WORKER, "quantized", str(out), "50"], 2, timeout_s=360, grace_s=5)
    assert code == 0, capfd.readouterr()
    runs = json.loads(out.read_text())
    fp32, int8, grads = runs["fp32"], runs["int8"], runs["int8_grads"]
    for run in (int8, grads):
        worst = max(abs(a - b) / abs(a) for a, b in zip(fp32["losses"], run["losses"]))
        assert 0 < worst <= LOSS_TOLERANCE, (worst, runs)  # quantized, not the same program
    # the gathers move int8 and a scale per 256 elements: a quarter of fp32's bytes, and a bit
    assert int8["gather_bytes"] <= 0.26 * fp32["gather_bytes"], runs
    # on the wire, counted by the runtime: with int8 gathers only, the reduce-scatters stay fp32
    assert int8["bytes_per_step"] < 0.7 * fp32["bytes_per_step"], runs
    # with the reductions in int8 too (all-to-all over shared memory), a quarter and the scales
    assert grads["shm"] and not fp32["shm"], runs
    assert grads["bytes_per_step"] <= 0.26 * fp32["bytes_per_step"], runs


def test_quantized_weights_need_zero3():
    with pytest.raises(DcirError) as e:
        Config.load({"zero_quantized_weights": True, "zero_stage": 1})
    assert "zero_quantized_weights quantizes ZeRO-3's parameter gathers: give zero_stage 3, not 1" in str(e.value)
    with pytest.raises(DcirError) as e:
        Config.load({"zero_quantized_gradients": True, "zero_stage": 2})
    why = "zero_quantized_gradients quantizes ZeRO-3's gradient reductions (ZeRO++'s qgZ): give zero_stage 3, not 2"
    assert why in str(e.value)
