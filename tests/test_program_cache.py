"""The program cache (docs/runtime.md, "Restarting fast: the program cache"): a job whose
model, code, config and world match an earlier one's reads its program and the plan its
optimization cycle took instead of capturing and profiling again, and trains to the
same numbers; anything the program depends on changes the key; an entry that cannot be
read back is compiled again; a resumed job without a cache plans again.

The multi-process restart (a checkpoint saved, every process killed, the job resumed
from the cache) is ``test_checkpoint.py::test_a_restarted_job_runs_the_cached_program_and_plan``."""

from __future__ import annotations

import importlib
import json
import sys
import warnings

import pytest
import torch

import dcir
from dcir_runtime import capture as capture_module
from dcir_runtime.config import Config
from dcir_runtime.plan import without_profiles
from dcir_runtime.program_cache import ProgramCache
from models import tiny_llama

# plans taken on the cost model's word, whatever peak they raise: these tests follow the cache, not trials
# or the price of memory (a gain of 5% priced against a raised peak flips with a loaded machine's profile)
CYCLE = {"optimize": {"passes": ["prefetch", "unshard"], "profile_at": [1], "trial_steps": 0, "memory_price": 0}}


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def _train(cache, steps: int = 3, config: dict | None = None):
    torch.manual_seed(0)
    engine = dcir.initialize(tiny_llama(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                             config={**CYCLE, "program_cache": str(cache), **(config or {})},
                             loss_fn=lambda out: out.loss)
    losses = []
    for ids in _batches(steps):
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def _no_compiling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the step was captured although the cache holds it")
    monkeypatch.setattr(capture_module, "compile_step", refuse)


def test_a_second_job_reads_the_program_and_plan_and_trains_the_same(tmp_path, monkeypatch):
    """The first job captures, profiles after step 1 and takes a plan; the cache then
    holds both. The second captures nothing, runs the plan from its first step, profiles
    nothing, and its losses and parameters are the first job's."""
    first, losses = _train(tmp_path)
    assert [r["switched"] for r in first.optimize_log] == [True]
    [entry] = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert entry["plan"] is not None and entry["planned_through"] == 2 and entry["program"].startswith("module")
    _no_compiling(monkeypatch)
    second, again = _train(tmp_path)
    assert again == losses
    assert [(r["pipeline"], r.get("cached")) for r in second.optimize_log] == \
        [(first.optimize_log[0]["pipeline"], True)]
    assert second.planner.profiled is None  # no step of it ran under the profiler
    assert dcir.print(second.ir()) == entry["plan"]
    for name, value in first.full_parameters().items():
        assert torch.equal(value, second.full_parameters()[name]), name


def test_the_cache_keeps_a_plan_on_trial_once_its_trial_decides(tmp_path, monkeypatch):
    """A plan on trial is not yet what the job keeps: the cache holds the captured program
    alone until the verdict, then the program that won (``runtime.trial``)."""
    config = {"optimize": {**CYCLE["optimize"], "trial_steps": 2}}
    first, _ = _train(tmp_path, steps=5, config=config)
    [record] = first.optimize_log
    assert record["reason"] == "on trial" and record["switched"], record
    [path] = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["plan"] is None
    # the same key: its plan was not cached. 14 steps: the profile (2), the trial's two looks
    # (3-8, and 9-14 when the first is undecided)
    first, losses = _train(tmp_path, steps=14, config=config)
    [record] = first.optimize_log
    entry = json.loads(path.read_text())
    assert record["reason"] in ("faster", "measured slower") and entry["log"] == json.loads(json.dumps([record]))
    assert entry["plan"] == dcir.print(without_profiles(first.module)), record
    assert ("plan.pipeline" in entry["plan"]) == record["switched"]
    _no_compiling(monkeypatch)
    second, again = _train(tmp_path, steps=14, config=config)
    assert again == losses and second.planner.profiled is None and second.planner.trial is None


def test_a_job_that_stops_before_its_last_profile_leaves_the_later_cycles_to_the_next(tmp_path, monkeypatch):
    """The cache keeps the steps whose profiles the plan has seen: a plan taken at the
    first of two ``profile_at`` steps leaves the second to the job that reads it."""
    config = {"optimize": {**CYCLE["optimize"], "profile_at": [1, 3]}}
    first, _ = _train(tmp_path, steps=2, config=config)
    assert len(first.optimize_log) == 1
    _no_compiling(monkeypatch)
    second, _ = _train(tmp_path, steps=5, config=config)
    assert [r.get("cached", False) for r in second.optimize_log] == [True, False]
    assert second.optimize_log[1]["step"] == 4


def test_a_resumed_job_without_a_cache_plans_again(tmp_path):
    """``profile_at`` counts the steps this engine ran, not a loaded checkpoint's: a job
    resumed at step 3 with ``profile_at: [1]`` profiles its own first step and plans."""
    first, _ = _train(tmp_path / "cache", steps=3)
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(0)
    resumed = dcir.initialize(tiny_llama(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), config=CYCLE,
                              loss_fn=lambda out: out.loss)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for ids in _batches(2):
        resumed.backward(resumed(input_ids=ids, labels=ids))
        resumed.step()
    assert resumed.steps == 5 and [r["step"] for r in resumed.optimize_log] == [2]


def test_an_entry_that_cannot_be_read_back_is_compiled_again(tmp_path):
    _, losses = _train(tmp_path, steps=1, config={"optimize": None})
    [path] = tmp_path.glob("*.json")
    path.write_text(path.read_text()[:1000])  # a write cut short, by hand: the cache's own are atomic
    with pytest.warns(UserWarning, match=r"the program cache entry .*\.json cannot be read back .*compiling again"):
        _, again = _train(tmp_path, steps=1, config={"optimize": None})
    assert again == losses and json.loads(path.read_text())["program"].startswith("module")


def test_a_cache_directory_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(dcir.DcirError) as e:
        dcir.initialize(torch.nn.Linear(4, 4), config={"program_cache": str(tmp_path / "file" / "cache")})
    assert f"config 'program_cache': cannot create {tmp_path / 'file' / 'cache'}" in e.value.render()


def test_a_bad_program_cache_value_names_the_key():
    with pytest.raises(dcir.DcirError) as e:
        Config.load({"program_cache": 3})
    assert "bad value for 'program_cache': 3; a directory path, or null" in e.value.render()


USER_CODE = '''
import torch
from {helper} import scale


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return scale(self.fc(x)).{reduce}()
'''


def _user_model(tmp_path, monkeypatch, reduce: str = "sum", factor: str = "2"):
    """A model whose class and whose helper live in files of their own (the user's code)."""
    (tmp_path / "user_helper.py").write_text(f"def scale(y):\n    return y * {factor}\n")
    (tmp_path / "user_model.py").write_text(USER_CODE.format(helper="user_helper", reduce=reduce))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("user_helper", "user_model"):
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    torch.manual_seed(0)
    return importlib.import_module("user_model").Net()


def _name(model, config: Config = Config(), call=("call",), loss_fn=None, world: int = 1, root=None) -> str:
    return ProgramCache(root, world).name(model, loss_fn, call, config)


def test_the_key_changes_with_everything_the_program_depends_on(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    base = _name(_user_model(tmp_path, monkeypatch), root=root)
    assert _name(_user_model(tmp_path, monkeypatch), root=root) == base  # the same model, built again
    changed = {
        "the model's code": _name(_user_model(tmp_path, monkeypatch, reduce="mean"), root=root),
        "a helper's code, in another file": _name(_user_model(tmp_path, monkeypatch, factor="3"), root=root),
        "the config": _name(_user_model(tmp_path, monkeypatch), Config(zero_stage=2), root=root),
        "the world": _name(_user_model(tmp_path, monkeypatch), world=2, root=root),
        "the inputs": _name(_user_model(tmp_path, monkeypatch), call=("other",), root=root),
        "the loss": _name(_user_model(tmp_path, monkeypatch), loss_fn=lambda y: y.sum(), root=root),
    }
    model = _user_model(tmp_path, monkeypatch)
    model.fc.weight.requires_grad_(False)
    changed["a frozen parameter"] = _name(model, root=root)
    model = _user_model(tmp_path, monkeypatch)
    model.eval()
    changed["the mode"] = _name(model, root=root)
    model = _user_model(tmp_path, monkeypatch)
    model.fc.register_forward_hook(lambda m, i, o: o * 2)
    changed["a hook"] = _name(model, root=root)
    assert _name(_user_model(tmp_path, monkeypatch), Config(timeout_s=5), root=root) == base  # not in the program
    assert len({base, *changed.values()}) == len(changed) + 1, changed


def test_the_key_follows_transformers_settings(tmp_path):
    """A ``transformers`` model's config and its checkpointing switch are in the key;
    the same model built again (in another process its config's hashes differ) is not."""
    torch.manual_seed(0)
    base = _name(tiny_llama(), root=tmp_path)
    assert _name(tiny_llama(), root=tmp_path) == base
    model = tiny_llama()
    model.config.rms_norm_eps = 1e-5
    assert _name(model, root=tmp_path) != base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _name(model, root=tmp_path)
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert len({base, checkpointed, _name(model, root=tmp_path)}) == 3


def test_a_cache_that_cannot_be_written_is_a_warning_and_the_job_goes_on(tmp_path, monkeypatch):
    from dcir_runtime import program_cache

    def full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(program_cache.os, "replace", full)
    with pytest.warns(UserWarning, match=r"cannot write the program cache entry .*\.json \(No space left on device\); "
                                         r"going on without it"):
        _, losses = _train(tmp_path, steps=2, config={"optimize": None})
    assert len(losses) == 2 and not list(tmp_path.iterdir())  # nothing half written is left
