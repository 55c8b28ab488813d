"""Shared test options: ``pytest --update-goldens`` rewrites the full-text snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/snapshots/* from the current output instead of comparing")


@pytest.fixture
def update_goldens(request) -> bool:
    return request.config.getoption("--update-goldens")
