"""``--slow-share K/N`` (``tests/conftest.py``): CI runs one share of the slow tier per
commit (``.ci/run``), so the N shares together must run every slow test exactly once,
keep a zoo model's cases (one world-2 launch) in one share, and leave the other tests
alone. Checked on a toy suite run by pytest in this process, with this suite's
conftest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ZOO = {m: [f"test_zoo[{m}-{p}]" for p in "xyz"] for m in "ab"}  # a model's paths: one group
SLOW = [f"test_slow[{k}]" for k in range(5)] + ZOO["a"] + ZOO["b"]
PLAIN = ["test_plain", "test_plain_too"]

_TOY = '''
import pytest

@pytest.mark.slow
@pytest.mark.parametrize("k", range(5))
def test_slow(k):
    pass

@pytest.mark.slow
@pytest.mark.parametrize("model,path", [(m, p) for m in "ab" for p in "xyz"])
def test_zoo(model, path):
    pass

def test_plain():
    pass

def test_plain_too():
    pass
'''


class _Passed:
    """The names of the tests that pass in a run."""

    def __init__(self):
        self.names: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.names.append(report.nodeid.rsplit("::", 1)[-1])


@pytest.fixture
def toy(tmp_path):
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    (tmp_path / "test_toy_share.py").write_text(_TOY)

    def run(*args: str) -> tuple[int, list[str]]:
        passed = _Passed()
        code = pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", "--import-mode=importlib", *args],
                           plugins=[passed])
        return code, passed.names
    return run


def test_the_shares_run_every_slow_test_once(toy):
    shares = [toy("-m", "slow", "--slow-share", f"{k}/3")[1] for k in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(SLOW)
    # the groups in order: test_slow[0]..[4], then test_zoo's models a and b, every 3rd
    assert [sorted(share) for share in shares] == [
        sorted(["test_slow[0]", "test_slow[3]", *ZOO["b"]]),
        ["test_slow[1]", "test_slow[4]"],
        sorted(["test_slow[2]", *ZOO["a"]]),
    ]


def test_a_share_leaves_the_other_tests_alone(toy):
    code, names = toy("--slow-share", "1/3")
    assert code == 0
    assert sorted(names) == sorted(PLAIN + ["test_slow[1]", "test_slow[4]"])


@pytest.mark.parametrize("share", ["3/3", "1", "a/3", "-1/3", "1/0"])
def test_a_share_that_is_not_k_of_n_is_a_usage_error(toy, share):
    code, names = toy("--slow-share", share)
    assert code == pytest.ExitCode.USAGE_ERROR and names == []


def test_ci_runs_a_rotating_share_of_the_slow_tier():
    """After the default suite, ``.ci/run`` runs share ``K`` of ``N`` with ``K`` the
    commit count modulo ``N``: any ``N`` consecutive commits run the whole slow tier."""
    ci = (HERE.parent / ".ci" / "run").read_text()
    command = r'python -m pytest -m slow --slow-share "\$\(\( \$\(git rev-list --count HEAD\) % (\d+) \)\)/\1"'
    assert re.search(rf"^{command}$", ci, re.MULTILINE), ci
    assert ci.index("python -m pytest -m slow") > ci.index("python -m pytest\n")  # after the default suite
