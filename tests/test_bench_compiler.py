"""The compiler benchmark measures a real module: its generator's output is valid
(shapes included, by torch's meta kernels) and canonical, and the script runs."""

from __future__ import annotations

import dcir

import bench_compiler  # benchmarks/ (pytest's pythonpath)


def test_generated_module_is_valid_and_canonical():
    text = bench_compiler.generate(layers=2)
    module = dcir.parse(text, "bench.dcir")
    dcir.verify(module, shapes=True)
    assert dcir.print(module) == text
    # roles and signature kinds declared: the simulator runs @forward and @backward once per micro-step
    assert [f.role for f in module.functions.values()] == ["forward", "backward"]
    assert bench_compiler.op_count(module) > 2000


def test_quick_run(tmp_path, capfd):
    out = tmp_path / "figures.json"
    assert bench_compiler.main(["--layers", "2", "--repeat", "1", "--json", str(out)]) == 0
    assert "target: parse + verify + print" in capfd.readouterr().out
    assert '"total_median_s"' in out.read_text()
