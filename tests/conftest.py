"""Shared test options: ``pytest --update-goldens`` rewrites the full-text snapshots;
``pytest -m slow --slow-share K/N`` runs share K of N of the slow tier (CI runs one share
per commit, so N consecutive commits run all of it); a zoo model's cases stay in one
share, so its world-2 runs are one launch."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/snapshots/* from the current output instead of comparing")
    parser.addoption("--slow-share", metavar="K/N", default=None,
                     help="of the slow tests, run only share K of N (0 <= K < N): the slow tests grouped by test "
                          "and first parameter, the groups in order, every Nth from the Kth; the other tests run "
                          "as usual")


def slow_share(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)``, or a usage error that says what is expected."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise pytest.UsageError(f"--slow-share {text}: expected K/N with 0 <= K < N, for example 1/4")
    return int(k), int(n)


def share_group(item) -> str:
    """The cases that go to one share together: a test with one value of its first
    parameter (a zoo model's paths, which share one world-2 launch), else the test case."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or not callspec.params:
        return item.nodeid
    first = next(iter(callspec.params))
    return f"{item.nodeid.partition('[')[0]}[{first}={callspec.params[first]!r}]"


def pytest_collection_modifyitems(config, items):
    text = config.getoption("--slow-share")
    if text is None:
        return
    k, n = slow_share(text)
    groups = sorted({share_group(item) for item in items if item.get_closest_marker("slow")})
    dropped = set(groups) - set(groups[k::n])
    deselected = [item for item in items if item.get_closest_marker("slow") and share_group(item) in dropped]
    config.hook.pytest_deselected(items=deselected)
    gone = set(deselected)
    items[:] = [item for item in items if item not in gone]


@pytest.fixture
def update_goldens(request) -> bool:
    return request.config.getoption("--update-goldens")
