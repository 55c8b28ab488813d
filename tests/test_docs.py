"""The language reference shows only what is true: every ```dcir block is a module
that parses and verifies, and every ```dcir-test block passes --verify-diagnostics."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

import custom_op_lib  # noqa: F401  (registers the custom ops of language.md §7.8's example)
import dcir
from dcir.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(dcir|dcir-test)\n(.*?)^```", re.M | re.S)


def _blocks():
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text[:m.start()].count("\n") + 2
            yield pytest.param(m.group(1), m.group(2), id=f"{doc.name}:{line}")


@pytest.mark.parametrize("kind,body", list(_blocks()))
def test_doc_block(kind: str, body: str):
    if kind == "dcir":
        dcir.verify(dcir.parse(body, "doc"))
        return
    err = io.StringIO()
    code = main(["-", "--split-input-file", "--verify-diagnostics"], stdin=io.StringIO(body),
                stdout=io.StringIO(), stderr=err)
    assert code == 0, err.getvalue()
