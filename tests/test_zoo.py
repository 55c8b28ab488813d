"""The model zoo (``tests/zoo.py``) trained through DCIR and compared with eager PyTorch.

Every model trains 3 AdamW steps (fp32) along each path and is compared, parameter by
parameter, with single-device eager training on the same batches (at most 1e-5 of
each tensor's scale):

* ``compile``: one process, ``torch.compile(model, backend="dcir")``, the loss
  ``out.loss + 0.01 * aux`` computed outside the compiled model (BatchNorm's running
  statistics compared too);
* ``engine-*``: world 2 through the Engine (ZeRO-3), one ``tests/zoo_worker.py`` launch
  per model for the loss forms the run selects of it: ``labels`` (the model's own loss, what the Engine
  runs today) and the issue's loops with the loss computed outside: ``criterion``
  (``criterion(out.logits, y)``), ``aux`` (``out.loss + 0.01 * aux``) and
  ``accumulate`` (``loss / 2`` with gradient accumulation 2).

A model that draws random numbers (``gpt2_dropout``) is compared under the same seed:
each run draws its masks from generator states the eager reference replays.

What fails today is ``xfail(strict=True)`` with its root cause, so a fix flips it.

By default a representative subset runs: every path of ``DEFAULT`` (a decoder LM, an
encoder masked LM with tied embeddings, a CNN with BatchNorm), and ``CLASSES``, one
model of each class the Engine must train like eager, on one Engine path each. The
rest is marked ``slow``: ``pytest -m slow tests/test_zoo.py`` runs it, and
``DCIR_ZOO=all pytest tests/test_zoo.py`` runs the whole zoo and rewrites the coverage
table in ``docs/models.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import dcir
from dcir_lowering.dynamo import benign_breaks
from dcir_runtime import native
from dcir_runtime.launch import launch
from zoo import FORMS, LR, TOLERANCE, ZOO, eager_reference, micro_batches, worst_relative

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "models.md"
WORKER = str(HERE / "zoo_worker.py")
ALL = os.environ.get("DCIR_ZOO") == "all"
DEFAULT = ("llama", "bert", "resnet")
#: (model, path) -> the class it stands for in the default run, beside ``DEFAULT``
CLASSES = {
    ("mixtral", "engine-aux"): "a mixture of experts, its router's aux loss in the loss",
    ("bart", "engine-labels"): "an encoder-decoder",
    ("gpt2_dropout", "engine-criterion"): "tied embeddings in a decoder, and dropout compared under a fixed seed",
}
ENGINE_FORMS = ("labels", "criterion", "aux", "accumulate")
PATHS = ("compile",) + tuple(f"engine-{f}" for f in ENGINE_FORMS)

# ---- what fails today, and why (the map issue 14's later work starts from) -------------

#: gap -> (what its error says, the root cause); docs/models.md's "Known gaps" says more
#: under the same names. A case expected to fail for one gap but failing otherwise is a
#: real failure (WrongReason), not an xfail: the map stays true. Empty: every row matches.
GAPS: dict[str, tuple[str, str]] = {}
XFAIL: dict[tuple[str, str], str] = {}  # (model, path) -> gap: none left


class WrongReason(Exception):
    """A case failed, but not for the gap it is marked with."""


@functools.cache
def parameters(name: str) -> int:
    return sum(p.numel() for p in ZOO[name].model().parameters())


def _cases():
    for name in ZOO:
        for path in PATHS:
            marks = []
            if (name, path) in XFAIL:
                reason = GAPS[XFAIL[name, path]][1]
                marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))
            if name not in DEFAULT and (name, path) not in CLASSES and not ALL:
                marks.append(pytest.mark.slow)
            yield pytest.param(name, path, marks=marks, id=f"{name}-{path}")


#: (model, path) -> its row of the coverage table, filled as the cases run
ROWS: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module", autouse=True)
def coverage_table():
    native.load()  # built once here, before the ranks start and load it
    yield
    if ALL:
        write_table(ROWS)


@pytest.fixture(scope="module")
def world2(request, tmp_path_factory):
    """One launch per model for the loss forms this run selects of it (``-m``, ``-k``):
    model -> {form: result}."""
    done: dict[str, dict] = {}
    selected = [item.callspec.params for item in request.session.items
                if getattr(item, "originalname", None) == "test_zoo_model_trains_like_eager"]

    def run(name: str) -> dict:
        if name not in done:
            paths = {p["path"] for p in selected if p["name"] == name}
            forms = [f for f in ENGINE_FORMS if f"engine-{f}" in paths]
            out = tmp_path_factory.mktemp("zoo") / f"{name}.json"
            code = launch([WORKER, name, str(out), *forms], 2, timeout_s=400, grace_s=5)
            done[name] = json.loads(out.read_text()) if code == 0 and out.exists() else {
                f: {"error": f"the world-2 launch ended with exit code {code}"} for f in forms}
        return done[name]
    return run


@pytest.mark.parametrize("name,path", list(_cases()))
def test_zoo_model_trains_like_eager(name, path, world2):
    z = ZOO[name]
    row = ROWS[name, path] = {"gap": XFAIL.get((name, path))}
    result = train_compiled(z) if path == "compile" else world2(name)[path.removeprefix("engine-")]
    row.update(result)
    gap = row["gap"]
    if gap is not None and "error" in result and GAPS[gap][0] not in result["error"]:
        raise WrongReason(f"expected to fail for gap {gap} ({GAPS[gap][0]!r}); failed with: {result['error']}")
    assert "error" not in result, result["error"]
    if not z.matches:
        assert result["trained"], "the parameters did not change, or a loss was NaN"
        return
    assert result["worst"] <= TOLERANCE, f"{result['where']}: {result['worst']:.2e} relative to eager"


def train_compiled(z) -> dict:
    """3 AdamW steps of ``torch.compile(model, backend="dcir")`` beside eager, the loss
    ``out.loss + 0.01 * aux`` computed outside the compiled model, each step of both from
    the same generator state (the same dropout masks). ``graphs``: how many
    the first step ran (graph breaks split it); ``recompiled``: graphs compiled again on a
    later step (a guard failed)."""
    loss_of, _ = FORMS["aux"]
    ref, mine = z.model(), z.model()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mine, backend="dcir")
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt_mine = torch.optim.AdamW([p for p in mine.parameters() if p.requires_grad], lr=LR)
    capture_s, graphs, losses = 0.0, 0, []
    try:
        for k, (inputs, y) in enumerate(micro_batches(z, 1, 1)):
            generator = torch.get_rng_state()
            loss_of(ref, inputs, y).backward()
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
            torch.set_rng_state(generator)
            begin = time.perf_counter()
            loss = loss_of(compiled, inputs, y)
            loss.backward()
            if k == 0:
                capture_s, graphs = time.perf_counter() - begin, counters["stats"]["unique_graphs"]
            opt_mine.step()
            opt_mine.zero_grad(set_to_none=True)
            losses.append(loss.item())
    except Exception as e:  # the row records why
        lines = [line.strip() for line in str(e).strip().split("\n") if line.strip()]
        return {"error": f"{type(e).__name__}: {' '.join(lines[:3])}"}
    finally:
        recompiled = counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
    result = {"graphs": graphs, "recompiled": recompiled - graphs, "capture_s": capture_s,
              "losses": losses}
    if not z.matches:
        fresh = dict(z.model().named_parameters())
        result["trained"] = all(math.isfinite(v) for v in losses) and any(
            not torch.equal(p, fresh[n]) for n, p in mine.named_parameters() if p.requires_grad)
        return result
    state = lambda m: {**dict(m.named_parameters()), **dict(m.named_buffers())}  # noqa: E731
    result["worst"], result["where"] = worst_relative(state(ref), state(mine))
    return result


# ---- the coverage table -----------------------------------------------------------------

BEGIN, END = "<!-- zoo table: begin (written by DCIR_ZOO=all pytest tests/test_zoo.py) -->", "<!-- zoo table: end -->"


def write_table(rows: dict) -> None:
    """The two tables between the markers of ``docs/models.md`` (the models, then each
    model's runs); the text around them (the known gaps, written by hand) is kept."""
    lines = [BEGIN, "", "| model | covers | parameters |", "|---|---|---:|"]
    lines += [f"| {name} | {z.covers} | {parameters(name):,} |" for name, z in ZOO.items()]
    lines += ["", "| model | path | graphs | capture s | worst rel. error | result |", "|---|---|---:|---:|---:|---|"]
    for (name, path), r in rows.items():
        graphs = f"{r['graphs']}" + (f" (+{r['recompiled']} recompiled)" if r.get("recompiled") else "") \
            if "graphs" in r else ""
        capture = f"{r['capture_s']:.1f}" if "capture_s" in r else ""
        worst = f"{r['worst']:.1e}" if r.get("worst") is not None else ""
        lines.append(f"| {name} | {path} | {graphs} | {capture} | {worst} | {_verdict(r)} |")
    lines += ["", END]
    text = DOC.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + "\n".join(lines) + text[stop:])


_SITE = re.compile(r"/\S*/site-packages/")
_ERROR = re.compile(r"(^|: )error: ")  # a DcirError's rendering inside another's


def _verdict(r: dict) -> str:
    if "error" in r:
        error = _ERROR.sub(r"\1", _SITE.sub("", r["error"])).replace("|", "\\|")
        error = error if len(error) <= 140 else error[:140] + "..."
        gap = f" (gap [{r['gap']}](#{r['gap']}))" if r.get("gap") else ""
        return f"fails{gap}: {error}"
    if r.get("trained") is not None:
        return "trains (dropout p=0.1, not compared)" if r["trained"] else "does not train"
    return "matches eager" if r["worst"] <= TOLERANCE else f"differs ({r['where']})"


# ---- benign graph breaks ------------------------------------------------------------------

_log = logging.getLogger("dcir.test_zoo")


class Chatty(torch.nn.Module):
    """Logs, warns and prints in forward, as library models do (transformers'
    ``logger.warning_once``); none of it is a reason to split the graph."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        _log.warning("Chatty.forward on %s rows", x.shape[0])
        warnings.warn("Chatty warns", UserWarning)
        h = torch.relu(self.fc1(x))
        print("Chatty prints", h.shape)
        return self.fc2(h).pow(2).mean()


def _three_adamw_steps(ref, program, mine, x) -> None:
    """Three AdamW steps of eager ``ref`` and of ``program`` (lowered over ``mine``'s state) on ``x``."""
    opt_ref, opt_mine = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    for _ in range(3):
        ref(x).backward()
        program.train_step(x)
        opt_ref.step(), opt_mine.step()
        opt_ref.zero_grad(), opt_mine.zero_grad()


def test_logging_warnings_and_print_do_not_break_capture(capsys, caplog):
    torch.manual_seed(0)
    ref, mine = Chatty(), Chatty()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="Chatty warns"):  # eagerly: all three happen
        ref(x)
    assert "Chatty prints" in capsys.readouterr().out and "Chatty.forward" in caplog.text
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning raised while traced would fail here
        module = dcir.compile_to_ir(mine, (x,))
    # one graph: the whole step, forward and backward; the three calls were ignored while traced
    assert set(module.functions) == {"forward", "backward"}
    assert "Chatty prints" not in capsys.readouterr().out and "Chatty.forward" not in caplog.text
    from dcir_lowering.program import state_of
    program = dcir.lower(module, state_of(mine))
    _three_adamw_steps(ref, program, mine, x)
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        assert torch.equal(a, b), n


def test_benign_breaks_make_one_graph_under_torch_compile(capsys):
    """``torch.compile(backend="dcir")`` splits the graph at the print (the calls before
    any tensor op leave nothing to split) unless they run
    under ``benign_breaks()`` (Dynamo's settings are the caller's: a backend sees the
    graph only after Dynamo has split it)."""
    torch.manual_seed(0)
    model, x = Chatty(), torch.randn(4, 8)
    for graphs, context in ((2, contextlib.nullcontext), (1, benign_breaks)):
        torch._dynamo.reset()
        counters.clear()
        with warnings.catch_warnings(), context():
            warnings.simplefilter("ignore")
            torch.compile(model, backend="dcir")(x).backward()
        assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


_HOOK_LOCK = threading.Lock()


class HooksOnFirstCall(torch.nn.Module):
    """Installs a forward hook on its first call under a ``threading.Lock``, as
    ``transformers``' ``maybe_install_capturing_hooks`` does, with BatchNorm and dropout
    whose state a warm-up call must not disturb."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5)

    def forward(self, x):
        if not getattr(self, "hooked", False):
            with _HOOK_LOCK:
                self.fc.register_forward_hook(lambda module, args, out: out * 3)
                self.hooked = True
        return self.drop(self.bn(self.fc(x))).pow(2).mean()


def test_first_call_setup_under_a_lock_runs_outside_the_trace():
    """Dynamo refuses ``with lock:`` (and the hook registration in it) under fullgraph;
    capture runs the step once eagerly on its private copy and traces again, so the
    captured program is what the model computes from its first call on: the hook's
    ``* 3`` is in it, the dropout mask and BatchNorm statistics are the eager ones."""
    torch.manual_seed(0)
    ref, mine, x = HooksOnFirstCall(), HooksOnFirstCall(), torch.randn(6, 8)
    mine.load_state_dict(ref.state_dict())
    module = dcir.compile_to_ir(mine, (x,))
    assert not getattr(mine, "hooked", False) and not mine.fc._forward_hooks  # the user's model is untouched
    assert torch.equal(mine.bn.running_mean, torch.zeros(8)) and int(mine.bn.num_batches_tracked) == 0
    assert "{other = 3}" in dcir.print(module)  # the hook installed by the warm-up was traced
    from dcir_lowering.program import state_of
    program = dcir.lower(module, state_of(mine))
    torch.manual_seed(1)
    expected = ref(x)
    torch.manual_seed(1)
    assert torch.equal(program.train_step(x), expected)
    assert torch.equal(mine.bn.running_mean, ref.bn.running_mean)


# ---- local fixes found in triage ------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", pytest.param("t5", marks=[] if ALL else [pytest.mark.slow])])
def test_backend_runs_models_that_make_constants_in_forward(name):
    """Decoders build their KV cache in forward (``use_cache=True`` is the default, also
    in training) from ``torch.tensor([])``, T5 its position buckets from
    ``torch.tensor(0)``: AOTAutograd lifts these into constants, which the backend read
    and rebuilt inside AOTAutograd's FakeTensorMode, so capture failed with FakeTensor's
    "Please convert all Tensors to FakeTensors first" assertion; ``aot_eager`` never had it."""
    z = ZOO[name]
    ref, mine = z.model(), z.model()
    inputs, y = z.batch(torch.Generator().manual_seed(0), 2)
    torch._dynamo.reset()
    out = torch.compile(mine, backend="dcir")(**inputs, labels=y)
    torch._dynamo.reset()
    assert out.past_key_values is not None  # the cache was built
    expected = ref(**inputs, labels=y).loss
    assert torch.equal(out.loss, expected)
    out.loss.backward()
    expected.backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


class Loop(torch.nn.Module):
    """A Python loop over a tensor's data-dependent entries, as transformers' ``eager``
    experts loop over the experts hit (``for expert_idx in expert_hit``)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        y = self.w.sum() * 0
        for i in torch.nonzero(x > 0)[:, 0]:
            y = y + self.w[i].sum()
        return y


def test_a_data_dependent_loop_is_a_located_error():
    """Dynamo reports data-dependent shapes as a UserError, not as Unsupported: capture
    let it through as torch's own multi-page error; it is the same located message as
    any graph break."""
    with pytest.raises(dcir.DcirError) as e:
        dcir.compile_to_ir(Loop(), (torch.randn(4),))
    message = e.value.render()
    assert "cannot capture the model as one graph: Consider annotating your code" in message
    assert f"(at {__file__}:" in message


class Pick(torch.nn.Module):
    """``w[:, idx]``: aten.index.Tensor with ``[None, idx]`` in forward and
    aten.index_put with the same list in backward."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 6, 4))
        self.register_buffer("idx", torch.tensor([4, 0, 4]))

    def forward(self, x):
        return (self.w[:, self.idx] * x).pow(2).mean()


def test_index_with_an_absent_entry_is_written_parsed_and_trained():
    """A list of optional tensors with absent entries was refused at capture ("an absent
    tensor in a list"); it is now its present tensors as operands and
    ``{indices.absent = [0]}``, which prints, parses, verifies and runs."""
    from dcir_lowering.program import state_of
    torch.manual_seed(0)
    ref, mine = Pick(), Pick()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(3, 3, 4)
    text = dcir.print(dcir.compile_to_ir(ref, (x,)))
    assert "aten.index.Tensor(%primals_1, %primals_2) {indices.absent = [0]} : f32[3, 3, 4]" in text
    assert "{indices.absent = [0], accumulate = true}" in text  # the backward's index_put
    module = dcir.parse(text)
    dcir.verify(module)
    assert dcir.print(module) == text
    program = dcir.lower(module, state_of(mine))
    _three_adamw_steps(ref, program, mine, x)
    assert torch.equal(ref.w, mine.w)
