"""Mixed precision: the pass's IR, the models' byte counts, the config, and training
across real processes (``precision_worker.py`` on 2 ranks, gloo on loopback, each
under a hard timeout)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import dcir
from dcir.cost import payload
from dcir.memory import peaks
from dcir_lowering.frontend import compile_to_ir
from dcir_runtime import Config, native
from dcir_runtime.launch import launch
from test_backend import mlp, squared

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "precision_worker.py")


def _run(capfd, case: str, out: Path, *extra: str, timeout_s: float = 300) -> dict:
    native.load()  # built once here, before the ranks start and load it
    code = launch([WORKER, case, str(out), *extra], 2, timeout_s=timeout_s, grace_s=5)
    text = capfd.readouterr()
    assert code == 0, text.out + text.err
    return {**json.loads(out.read_text()), "_stderr": text.err}


def _captured(param_dtype=None) -> dcir.Module:
    torch.manual_seed(0)
    module = compile_to_ir(mlp(), (torch.randn(4, 8),), loss_fn=squared, param_dtype=param_dtype)
    pipeline = "zero3" + (",mixed_precision" if param_dtype is not None else "")
    return dcir.run_passes(module, pipeline)


def test_the_models_count_the_smaller_gathers():
    """The cost model's payload of every all_gather and the memory model's peak of
    gathered parameters, from the types' byte sizes: half in bf16; the reductions
    stay fp32 (reduce_dtype), so their payload does not change."""
    f32, bf16 = _captured(), _captured(torch.bfloat16)

    def moved(module, kind):
        return sum(payload(op) for _, op in module.ops() if op.name == f"comm.{kind}")
    assert moved(f32, "all_gather") == 2 * moved(bf16, "all_gather") > 0
    assert moved(f32, "reduce_scatter") == moved(bf16, "reduce_scatter") > 0
    casts = [op for _, op in bf16.ops() if op.name == "mem.cast"]
    assert casts and all(op.results[0].type.nbytes * 2 == op.operands[0].type.nbytes
                         for op in casts if op.operands[0].type.dtype == "f32")
    assert peaks(bf16)["forward"] < peaks(f32)["forward"]
    assert all(d.type.dtype == "f32" for d in bf16.decls.values())


def _collectives(module: dcir.Module) -> Counter:
    return Counter(op.name for _, op in module.ops() if op.name.startswith("comm."))


@pytest.mark.parametrize("pipeline", ["unshard", "bucket", "prefetch,unshard,bucket", "unshard{micro_steps=2}"])
def test_the_schedule_passes_take_the_gathers_of_cast_shards(pipeline):
    """In bf16 each gather sends its shard cast first (``mem.cast``): ``unshard`` hands the
    forward's gathered weight to the backward, or under accumulation gathers it once a
    step into a bf16 copy, and ``bucket`` coalesces such gathers, moving each cast up with
    its shard read, as they do in fp32 (until 2026-11-30 neither touched a gather of a cast
    shard, and the benchmark's bf16 plans gathered every weight twice, one at a time). The
    backward that keeps a weight reads neither its shard nor a cast of it."""
    f32, bf16 = dcir.run_passes(_captured(), pipeline), dcir.run_passes(_captured(torch.bfloat16), pipeline)
    assert _collectives(bf16) == _collectives(f32)
    assert _collectives(bf16) != _collectives(_captured(torch.bfloat16))
    backward = bf16.role("backward")
    if pipeline in ("unshard", "prefetch,unshard,bucket"):
        assert not [op for op in backward.ops if op.name == "param.get" or "all_gather" in op.name]
    if "unshard" in pipeline:
        assert [op.name for op in backward.ops if op.name == "mem.cast"] == ["mem.cast"] * 4  # the gradients'
    copies = {d.name: str(d.type) for d in bf16.decls.values() if d.kind == "buffer"}
    assert copies == ({"0.weight.unsharded": "bf16[16, 8]", "0.bias.unsharded": "bf16[16]",
                       "2.weight.unsharded": "bf16[4, 16]", "2.bias.unsharded": "bf16[4]"}
                      if "micro_steps" in pipeline else {})
    if copies:  # @unshard sends each shard cast, as the gathers it replaced did
        unshard = bf16.role("unshard")
        assert [op.name for op in unshard.ops if op.name in ("mem.cast", "comm.all_gather")] == \
            ["mem.cast", "comm.all_gather"] * 4


def test_capture_in_bf16_casts_inputs_and_output():
    """cast_forward_inputs: the f32 input is cast inside the graph (the forward's
    argument stays f32); output_dtype: the model's output is cast before the loss."""
    module = compile_to_ir(mlp(), (torch.randn(4, 8),), loss_fn=squared, param_dtype=torch.bfloat16,
                           output_dtype=torch.float32)
    fw = module.functions["forward"]
    assert str(fw.args[0].type) == "f32[4, 8]"
    casts = [op for op in fw.ops if op.name == "aten._to_copy.default"]
    assert [op.results[0].type.dtype for op in casts] == ["bf16", "f32"]
    assert fw.returns[0].type.dtype == "f32"  # the loss, computed from the f32 output


@pytest.mark.parametrize("config, message", [
    ({"mixed_precision": {"param_dtype": "bfloat61"}},
     "bad value for 'mixed_precision': unknown dtype 'bfloat61'; valid dtypes: float32 (f32), bfloat16 (bf16), "
     "float16 (f16), float64 (f64)"),
    ({"mixed_precision": {"param_dtype": "int8"}}, "unknown dtype 'int8'; valid dtypes: float32 (f32)"),
    ({"mixed_precision": {"param_dtype": "bf16", "buffer_dtype": "bf16"}},
     "bad value for 'mixed_precision': unknown key 'buffer_dtype' in 'mixed_precision'; valid keys: param_dtype, "
     "reduce_dtype, output_dtype, cast_forward_inputs"),
    ({"mixed_precision": {"cast_forward_inputs": "yes"}}, "'cast_forward_inputs' is 'yes'; true or false"),
    ({"mixed_precision": "bf16"}, "bad value for 'mixed_precision': 'bf16'; an object like"),
    ({"fp16": {"enabled": True, "loss_scale_windows": 10}},
     "bad value for 'fp16': unknown key 'loss_scale_windows' in 'fp16'; valid keys: enabled, loss_scale, "
     "initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, consecutive_hysteresis"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "bad value for 'fp16': 'hysteresis' is 0; a whole number >= 1"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "'loss_scale' is -1; a finite number >= 0"),
    ({"fp16": {"enabled": "true"}}, "'enabled' is 'true'; true or false"),
    ({"fp16": True}, "bad value for 'fp16': True; an object like"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bad value for 'bf16':"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "the config enables bf16 and fp16: give one of mixed_precision, bf16, fp16"),
    ({"mixed_precision": {"param_dtype": "bf16"}, "bf16": {"enabled": True}},
     "the config enables mixed_precision and bf16"),
    ({"precision": "bf16"}, "unknown config key 'precision'; valid keys: zero_stage, "),
])
def test_bad_precision_config_names_the_key_and_the_valid_values(config, message):
    with pytest.raises(dcir.DcirError) as e:
        Config.load(config)
    assert message in e.value.render()


def test_precision_config_defaults():
    from dcir_runtime.precision import Policy, policy_of

    # FSDP2: reduce_dtype None follows param_dtype
    assert policy_of(Config.load({"mixed_precision": {"param_dtype": "bfloat16"}})) == Policy("bf16", "bf16")
    assert policy_of(Config.load({"mixed_precision": {"param_dtype": "torch.bfloat16", "reduce_dtype": "float"}})) \
        == Policy("bf16", "f32")
    assert policy_of(Config.load({"bf16": {"enabled": True}})) == Policy("bf16", "f32")
    assert policy_of(Config.load({"fp16": {"enabled": True}})) == Policy("f16", "f32")
    assert not policy_of(Config.load({"fp16": {"enabled": False}})).active  # DeepSpeed's off switch
    assert Config.load({"fp16": {"enabled": True}}).fp16["initial_scale_power"] == 16


def test_dynamic_loss_scale_follows_deepspeed():
    """Hysteresis 2: the first overflow only spends it, the second halves the scale;
    loss_scale_window clean steps double it; never below min_loss_scale."""
    from dcir_runtime.precision import LossScaler, check_fp16

    s = LossScaler(check_fp16({"enabled": True, "initial_scale_power": 4, "loss_scale_window": 3,
                               "min_loss_scale": 4}))
    seen = []
    for overflow in (True, True, False, False, False, True, True, True, True):
        s.update_scale(overflow)
        seen.append(s.cur_scale)
    assert seen == [16, 8, 8, 8, 16, 16, 8, 4, 4]
    static = LossScaler(check_fp16({"enabled": True, "loss_scale": 128}))
    static.update_scale(True)
    assert static.cur_scale == 128


def _scales(fp16: dict, overflows) -> list[float]:
    """The loss scale after each step of an fp16 engine's scaler (built from the config
    as the Engine builds it), given which steps overflow."""
    from dcir_runtime.precision import Precision

    scaler = Precision(Config.load({"fp16": {"enabled": True, "initial_scale_power": 4, **fp16}})).loss_scaler
    seen = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        seen.append(scaler.cur_scale)
    return seen


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_overflows_in_a_row_halve_the_scale(hysteresis):
    """docs/config.md: the scale halves at the ``hysteresis``-th overflow (the ones before
    are tolerated), and at every overflow after it until the hysteresis is refilled."""
    assert _scales({"hysteresis": hysteresis}, [True] * (hysteresis + 1)) == [16] * (hysteresis - 1) + [8, 4]


def test_consecutive_hysteresis_refills_after_every_clean_step():
    """Overflows with a clean step between each (never ``loss_scale_window`` clean steps
    in a row): with consecutive_hysteresis the clean step refills the hysteresis, so
    the scale never halves; without it, only a doubling refills it, so from the second
    overflow on every overflow halves."""
    apart = [True, False] * 4
    assert _scales({"hysteresis": 2, "consecutive_hysteresis": True}, apart) == [16] * 8
    assert _scales({"hysteresis": 2}, apart) == [16, 16, 8, 8, 4, 4, 2, 2]
    # a window of clean steps doubles the scale and refills the hysteresis either way
    for consecutive in (True, False):
        assert _scales({"hysteresis": 2, "loss_scale_window": 2, "consecutive_hysteresis": consecutive},
                       [True, True, False, False, True]) == [16, 8, 8, 16, 16]


def test_bf16_matches_a_reference_that_casts_per_micro_batch(tmp_path, capfd):
    """World 2, param_dtype=bf16 and reduce_dtype=fp32 (and DeepSpeed's bf16 section;
    at ZeRO-3, ZeRO-2, with optimizer-state offload and with the schedule passes; a
    transformer, also with the schedule passes from the first step, which keep its bf16
    weights from forward to backward and coalesce its gathers, and under 2 micro-steps
    gather them once a step into bf16 copies; ZeRO-1 and ZeRO-3 summing 2 micro-steps'
    full gradients in fp32),
    5 AdamW steps: the fp32 master parameters match the reference in the worker to
    1e-5; a reference without the casts is 1e-3 away, so the casts are what is matched."""
    r = _run(capfd, "reference", tmp_path / "out.json")
    for name in ("mixed_precision", "bf16", "zero2", "offload", "optimized", "transformer", "zero1_accumulate2",
                 "transformer_scheduled", "transformer_accumulate2_scheduled", "full_accumulate2"):
        case = r[name]
        print(name, "largest relative difference", case["max_rel_err"], "vs fp32 reference", case["fp32_rel_err"])
        assert case["max_rel_err"] <= 1e-5
        assert case["fp32_rel_err"] > 1e-4
        assert case["loss_dtype"] == "torch.bfloat16" and case["master_not_bf16"]
        assert case["shard_dtypes"] == case["state_dtypes"] == ["torch.float32"]
    assert r["offload"]["host_state"] > 0 and r["zero2"]["host_state"] == 0 and r["optimized"]["replans"] == 1
    plain, scheduled = r["transformer"]["collectives"], r["transformer_scheduled"]["collectives"]
    print("collectives, zero3:", plain, "with prefetch,unshard,bucket:", scheduled)
    assert plain["backward"]["comm.all_gather"] > 0 and "comm.all_gather_coalesced" not in plain["forward"]
    assert "comm.all_gather" not in scheduled["backward"]  # every bf16 weight kept from the forward
    assert scheduled["forward"].get("comm.all_gather_coalesced", 0) > 0
    accumulated = r["transformer_accumulate2_scheduled"]["collectives"]  # gathered once a step, by @unshard
    print("under 2 micro-steps:", accumulated)
    assert [f for f, counts in accumulated.items() if any("all_gather" in op for op in counts)] == ["unshard"]
    full = r["full_accumulate2"]["collectives"]  # the fp32 sum reduce-scattered once, in the last micro-step
    assert "comm.reduce_scatter" not in full["backward"] and full["backward_last"]["comm.reduce_scatter"] > 0, full


def test_bf16_training_matches_fsdp2(tmp_path, capfd):
    """20 AdamW steps of DCIR and FSDP2 under MixedPrecisionPolicy(bf16, fp32), CPU and
    gloo: the same casts in the same places give the same numbers (measured: identical
    losses and parameters). The losses are bf16 numbers, so a difference in one is at
    least a bf16 rounding step (~4e-3 relative); the full parameters after the 20 steps
    are held to 1e-5. DCIR in fp32, the whole bf16 effect, is ~6e-3 away in the parameters
    and ~2e-2 in the losses; reducing the gradients in bf16 instead, ~3e-3 and ~8e-3."""
    r = _run(capfd, "fsdp2", tmp_path / "out.json")
    losses, err = r["loss"], r["param_rel_err"]

    def worst(name):
        return max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["fsdp2"]))
    print("DCIR vs FSDP2, largest relative difference of the losses:", worst("bf16"), "of the parameters:",
          err["bf16"], "| DCIR fp32 vs FSDP2 bf16:", worst("fp32"), err["fp32"])
    assert len(losses["bf16"]) == len(losses["fsdp2"]) == 20
    assert worst("bf16") <= 1e-4 and err["bf16"] <= 1e-5
    assert err["fp32"] > 1e-3  # the policy's rounding is far above the tolerance: the casts are what match
    assert losses["bf16"][-1] < losses["bf16"][0] / 4  # it trains


def test_fp16_overflow_skips_the_step_and_the_schedule_and_halves_the_scale(tmp_path, capfd):
    """docs/config.md: a skipped step leaves the weights, ``engine.steps`` and the
    learning-rate schedule (here halving the rate at each step) where they were."""
    r = _run(capfd, "overflow", tmp_path / "out.json", str(tmp_path / "ckpt"))
    assert r["took"] == [True, False, True]
    assert r["scales"] == [256.0, 256.0, 128.0, 128.0]
    assert r["changed"] == [True, False, True] and all(r["finite"])
    assert (r["skipped_steps"], r["steps"]) == (1, 2)
    assert r["lrs"] == [1e-2, 5e-3, 5e-3, 2.5e-3] and r["schedule_steps"] == 2
    assert "dcir: step 2: inf/NaN gradients, step skipped (1 so far); loss scale 256 -> 128" in r["_stderr"]
    assert r["scaler_loaded"] == r["scaler_saved"] and r["scaler_saved"]["cur_iter"] == 3
    off = r["offload"]  # the same with optimizer state in host memory: the same weights
    assert off["took"] == r["took"] and off["host_state"] > 0 and off["max_diff"] == 0


def test_bf16_gathers_move_half_the_bytes(tmp_path, capfd):
    """The runtime's count of bytes sent by a forward (which only gathers)."""
    r = _run(capfd, "bytes", tmp_path / "out.json")
    print("forward bytes sent, fp32:", r["f32"]["forward_sent"], "bf16:", r["bf16"]["forward_sent"])
    assert r["f32"]["forward_sent"] == 2 * r["bf16"]["forward_sent"] > 0
    assert "mem.cast" in r["bf16"]["ir"] and "pending<bf16[16, 8]>" in r["bf16"]["ir"]


def test_the_config_reference_lists_every_key():
    """docs/config.md has a row for every key the Engine accepts, and for every key of
    the precision sections, each with its FSDP2 and DeepSpeed columns."""
    import dataclasses

    from dcir_runtime import precision

    doc = (HERE.parent / "docs" / "config.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines() if line.startswith("| `")}
    for f in dataclasses.fields(Config):
        assert f"`{f.name}`" in rows, f"docs/config.md does not list the config key {f.name}"
        assert rows[f"`{f.name}`"].count("|") == 6, f"the row of {f.name} needs its FSDP2 and DeepSpeed columns"
    for key in [*precision._POLICY_KEYS, *precision._FP16_KEYS]:
        assert f"`{key}`" in rows, f"docs/config.md does not list {key}"


def test_dcir_train_precision_flag(capfd):
    """--precision adds the config's section: checked before any rank starts, and the
    summary says what ran (fp16: the first step's 65536 overflows fp16 and is skipped)."""
    from dcir_runtime.train import main

    assert main(["--precision", "bf16", "--config", '{"fp16": {"enabled": true}}']) == 1
    assert "the config enables bf16 and fp16: give one of" in capfd.readouterr().err
    code = main(["--precision", "fp16", "--steps", "2", "--layers", "1", "--hidden", "64", "--seq", "32",
                 "--batch", "2", "--timeout", "300"])
    out = capfd.readouterr()
    assert code == 0, out.out + out.err
    assert "precision       compute and gathers in f16, gradients reduced in f32, master weights f32; " \
           "loss scale 65536, 1 steps skipped (inf/NaN)" in out.out
    assert "final loss" in out.out and "(step 2)" in out.out
