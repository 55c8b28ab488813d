"""An inf or NaN loss or gradient at an optimizer step (config ``nonfinite``,
``runtime/precision.py``): an error that names the step, the ranks and the first
parameter it shows in, the same on every rank, that changes nothing; or, with
``"skip"``, a skipped step. World 2 runs in ``nonfinite_worker.py`` (gloo on loopback,
under a hard timeout); world 1 in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dcir
from dcir_runtime import Config, native
from dcir_runtime.launch import launch
from dcir_runtime.precision import _nonfinite_here

HERE = Path(__file__).resolve().parent
TAIL = "the step's gradients were dropped, nothing else changed (config nonfinite 'skip' skips such steps)"
FP16 = "fp16's loss scaler skips the steps that overflow: give nonfinite 'skip' or leave it out, not 'error'"


def test_world2_a_nan_loss_is_the_same_error_on_every_rank_or_a_skipped_step(tmp_path, capfd):
    native.load()  # built once here, before the ranks start and load it
    code = launch([str(HERE / "nonfinite_worker.py"), str(tmp_path / "out.json")], 2, timeout_s=180, grace_s=5)
    text = capfd.readouterr()
    assert code == 0, text.out + text.err
    ranks = json.loads((tmp_path / "out.json").read_text())
    for r in ranks:
        error = r["error"]  # rank 1's second micro-step of step 2 is NaN
        assert error["message"] == ("error: step 2: the loss is nan (rank 1, micro-step 2); the first non-finite "
                                    f"gradient is 0.weight's (ranks 0, 1); {TAIL}")
        assert error["took"] == [False, True, False, "raised", False, True]
        assert error["unchanged"] == {"parameters": True, "optimizer_state": True, "lr": True, "steps": 1,
                                      "grads": True}
        assert (error["steps"], error["schedule_steps"]) == (2, 2)
        skip = r["skip"]
        assert skip["took"] == [True, False, True] and skip["changed"] == [True, False, True]
        assert (skip["skipped_steps"], skip["steps"], skip["schedule_steps"], skip["lr"]) == (1, 2, 2, [2.5e-3])
        assert skip["equals_a_run_without_that_batch"]
        poisoned = r["poisoned"]  # rank 1's shard of 2.weight holds a NaN: both ranks' losses are NaN
        assert poisoned["message"] == ("error: step 1: the loss is nan (rank 0, micro-step 1, and 1 more non-finite "
                                       f"loss on rank 1); the first non-finite parameter is 2.weight (rank 1); {TAIL}")
        assert poisoned["seconds"] < 10
    assert text.err.count("dcir: step 2: the loss is nan (rank 1, micro-step 1); the first non-finite gradient is "
                          "0.weight's (ranks 0, 1); step skipped (1 so far)") == 1  # rank 0 says it


def _linear(config: dict | None = None):
    torch.manual_seed(0)
    return dcir.initialize(torch.nn.Linear(8, 4), lambda ps: torch.optim.AdamW(ps, lr=1e-2), config)


def test_world1_an_inf_loss_is_an_error_that_changes_nothing_and_training_goes_on():
    engine, x = _linear(), torch.randn(2, 8)
    engine.backward(engine(x).pow(2).mean())
    assert engine.step()
    before = {n: s.detach().clone() for n, s in engine.shards.items()}
    state = [(k, v.clone()) for s in engine.optimizer.state.values() for k, v in s.items()]
    engine.backward(engine(x).pow(2).mean() * float("inf"))
    with pytest.raises(dcir.DcirError) as e:
        engine.step()
    assert e.value.render() == (f"error: step 2: the loss is inf (rank 0, micro-step 1); the first non-finite gradient "
                                f"is weight's (rank 0); {TAIL}")
    assert all(torch.equal(before[n], s) and s.grad is None for n, s in engine.shards.items())
    after = [(k, v) for s in engine.optimizer.state.values() for k, v in s.items()]
    assert len(after) == len(state) == 6 and all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(state, after))
    assert (engine.steps, engine.skipped_steps) == (1, 0)
    engine.backward(engine(x).pow(2).mean())
    assert engine.step() and engine.steps == 2


def test_world1_skip_a_nan_gradient_of_a_finite_loss(caplog):
    """The loss engine.backward saw is finite, a gradient is not; through a plain
    ``loss.backward()`` the engine sees no loss and says nothing of it."""
    engine, x = _linear({"nonfinite": "skip"}), torch.randn(2, 8)
    before = {n: s.detach().clone() for n, s in engine.shards.items()}
    with caplog.at_level("WARNING", logger="dcir"):
        out = engine(x)
        out.register_hook(lambda g: g * float("nan"))
        engine.backward(out.pow(2).mean())
        assert not engine.step()
        out = engine(x)
        out.register_hook(lambda g: g * float("nan"))
        out.pow(2).mean().backward()
        assert not engine.step()
    assert caplog.messages == [
        "dcir: step 1: the loss is finite; the first non-finite gradient is weight's (rank 0); step skipped (1 so far)",
        "dcir: step 1: the first non-finite gradient is weight's (rank 0); step skipped (2 so far)"]
    assert all(torch.equal(before[n], s) and s.grad is None for n, s in engine.shards.items())
    assert (engine.steps, engine.skipped_steps, engine.optimizer.state) == (0, 2, {})


@pytest.mark.parametrize("config, message", [
    ({"nonfinite": "ignore"}, "bad value for 'nonfinite': 'ignore'; one of error, skip (or null: error, and fp16's "
                              "skipping under fp16)"),
    ({"nonfinite": "error", "fp16": {"enabled": True}}, FP16),
])
def test_bad_nonfinite_config_says_what_is_valid(config, message):
    with pytest.raises(dcir.DcirError) as e:
        Config.load(config)
    assert e.value.render() == f"error: {message}"


def test_nonfinite_defaults_to_error_and_skip_agrees_with_fp16():
    assert Config.load({}).nonfinite is None  # "error"; under fp16 the loss scaler's skipping
    assert Config.load({"nonfinite": "skip", "fp16": {"enabled": True}}).nonfinite == "skip"
    assert Config.load({"nonfinite": "error", "bf16": {"enabled": True}}).nonfinite == "error"


def test_the_fast_check_settles_finite_steps_and_defers_overflowing_norms_to_the_elements():
    def shards(*values):
        out = {}
        for k, v in enumerate(values):
            p = torch.nn.Parameter(torch.zeros(3))
            p.grad = torch.tensor([1.0, v, -2.0])
            out[f"p{k}"] = p
        return out
    loss = [(1, torch.tensor(0.5))]
    assert not _nonfinite_here(loss, shards(1.0, 3.0))
    # finite gradients whose norm overflows fp32 are finite: the element check decides
    assert not _nonfinite_here(loss, shards(1e30, 3.0))
    assert _nonfinite_here(loss, shards(1.0, float("nan")))
    assert _nonfinite_here(loss, shards(float("-inf"), 3.0))
    assert _nonfinite_here([(1, torch.tensor(float("inf")))], shards(1.0))
