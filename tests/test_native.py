"""The C++ runtime's build switch (``$DCIR_NATIVE_BUILD``), its build lock and its c10d calls."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from dcir_runtime import native


def test_auto_says_which_build_and_why(monkeypatch):
    monkeypatch.delenv("DCIR_NATIVE_BUILD", raising=False)
    variant, reason = native.choose()
    if not torch.cuda.is_available():
        assert variant == "cpu"
        assert "DCIR_NATIVE_BUILD=cuda" in reason  # and how to get the other one
    assert str(native.BuildInfo(variant, reason, False, native.cache_dir())).startswith(
        f"dcir native runtime: {variant.upper()} build (")


def test_cpu_is_forced_by_name(monkeypatch):
    monkeypatch.setenv("DCIR_NATIVE_BUILD", "cpu")
    assert native.choose() == ("cpu", "DCIR_NATIVE_BUILD=cpu")


def test_an_unknown_variant_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("DCIR_NATIVE_BUILD", "rocm")
    with pytest.raises(native.NativeBuildError, match="DCIR_NATIVE_BUILD='rocm'; valid: auto, cpu, cuda"):
        native.choose()


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_a_forced_cuda_build_on_a_cpu_torch_says_what_is_missing():
    with pytest.raises(native.NativeBuildError, match="was built without CUDA; install a CUDA build of torch"):
        native.choose("cuda")


def test_every_registered_op_is_listed():
    assert {"all_gather", "reduce_scatter", "wait", "free", "get_shard", "has_cuda"} <= set(native.registered_ops())


#: c10d's deprecated names, and the compile-time fallbacks allowed to name them (for a
#: torch older than 2.13, where they are the current API)
DEPRECATED = {"_allgather_base": "gather_into", "_reduce_scatter_base": "reduce_scatter_into",
              "alltoall_base": "all_to_all_into", "allgather_into_tensor_coalesced": None,
              "reduce_scatter_tensor_coalesced": None}


def test_no_deprecated_c10d_call_outside_the_fallbacks():
    source = native.SOURCE.read_text()
    functions = {m.group(1): m.start() for m in re.finditer(r"intrusive_ptr<Work> (\w+)\(PG& pg", source)}
    for name, allowed in DEPRECATED.items():
        for m in re.finditer(rf"\b{name}\(", source):
            enclosing = max((f for f, at in functions.items() if at < m.start()), key=functions.get, default=None)
            end = source.find("\n}\n", functions.get(enclosing, 0))
            assert allowed is not None and enclosing == allowed and m.start() < end, \
                f"native/dcir_runtime.cpp calls the deprecated c10d {name} at offset {m.start()}"


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path, capsys):
    (tmp_path / "lock").write_text("")  # torch's builder's lock: its holder died mid-build
    with native._exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert f"dcir native runtime: removed {tmp_path / 'lock'}, left by a build that was killed" in capsys.readouterr().err


def test_a_process_waiting_for_anothers_build_says_so(tmp_path, capsys):
    entered = threading.Event()

    def second():
        with native._exclusive(tmp_path, note_after_s=0.2):
            entered.set()

    with native._exclusive(tmp_path):  # the build under way
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(1.0)
        assert not entered.is_set()
    waiter.join(timeout=10)
    assert entered.is_set()
    assert f"dcir native runtime: waiting for another process's build in {tmp_path}" in capsys.readouterr().err
