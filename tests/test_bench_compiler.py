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


def test_mixture_of_experts_routes_evenly_through_valid_shapes():
    """Mixtral's sparse MLP in place of each layer's: a router, ``top_k`` of ``experts``
    per token, each expert taking an even share of the rows, every shape as torch's meta
    kernels compute it; every parameter of it gathered and its gradient reduced once."""
    text = bench_compiler.generate(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=100, seq=16,
                                   micro_batches=1, offload=False, experts=4, top_k=2)
    module = dcir.parse(text, "moe.dcir")
    dcir.verify(module, shapes=True)
    assert dcir.print(module) == text
    experts = [n for n in module.decls if ".block_sparse_moe.experts." in n]
    assert len(experts) == 2 * 4 * 3 and not [n for n in module.decls if ".mlp." in n]
    rows = [op.results[0].type.shape for op in module.functions["forward"].ops if op.name == "aten.index_select.default"]
    assert rows.count((8, 64)) == 2 * 4  # 16 tokens × top 2 over 4 experts: 8 rows each
    backward = module.functions["backward"].ops
    reduced = [op.operands[0].name for op in backward if op.name == "comm.reduce_scatter"]
    assert len(reduced) == len(module.decls) - 1  # all but the inv_freq buffer, once each
    try:
        bench_compiler.generate(layers=1, seq=15, micro_batches=1, experts=4, top_k=2)
    except ValueError as e:
        assert str(e) == "top_k is in 1..experts, and tokens × top_k split evenly over the experts"
    else:
        raise AssertionError("30 routed rows do not split over 4 experts")


def test_quick_run(tmp_path, capfd):
    out = tmp_path / "figures.json"
    assert bench_compiler.main(["--layers", "2", "--repeat", "1", "--json", str(out)]) == 0
    assert "target: parse + verify + print" in capfd.readouterr().out
    assert '"total_median_s"' in out.read_text()
