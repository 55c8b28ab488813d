"""``dcir_runtime.hf.DcirTrainer``: the transformers Trainer script of docs/integrations.md
(``docs/examples/trainer_dcir.py``) under torchrun at world 2, against the same script
under the stock Trainer (DDP); stopped by SIGKILL and resumed; and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcir
from dcir_runtime.hf import DcirTrainer, EngineOptimizer
from jobs import run_job

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "examples" / "trainer_dcir.py"


def _launch(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           # the agent's shared store hands restarted workers dead addresses (pytorch/pytorch#135712)
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out.parent.mkdir(parents=True, exist_ok=True)
    return run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(SCRIPT), "--out", str(out), *extra], 300, env=env, cwd=out.parent)


def _final(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script under DcirTrainer and under the stock Trainer (DDP), at world 2."""
    root = tmp_path_factory.mktemp("trainer")
    for name, extra in (("dcir", ()), ("ddp", ("--stock",))):
        run = _launch(root / name, *extra)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return root


def test_the_trainer_script_logs_the_losses_of_ddp(runs):
    """30 optimizer steps of 2 x 2 micro-batches with warmup, a cosine schedule, weight
    decay and clipping, evaluated every 10: every logged loss, training and evaluation,
    within 1e-5 of DDP's (the gradients' sums run in another order)."""
    ours, theirs = (json.loads((runs / name / "log.json").read_text()) for name in ("dcir", "ddp"))
    for key, steps in (("loss", list(range(1, 31))), ("eval_loss", [10, 20, 30])):
        assert [s for s, _ in ours[key]] == [s for s, _ in theirs[key]] == steps
        worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(ours[key], theirs[key]))
        assert worst <= 1e-5, (key, worst, ours, theirs)
    assert ours["loss"][-1][1] < ours["loss"][0][1]  # it learns


def test_killed_at_step_15_and_resumed_ends_bit_for_bit(runs, tmp_path):
    """Rank 1 SIGKILLed at the end of step 15 (before that step's checkpoint): the job
    fails; restarted with resume_from_checkpoint it continues from checkpoint-10 and ends
    at the parameters of the uninterrupted run, bit for bit; its saved model loads with
    from_pretrained."""
    from transformers import LlamaForCausalLM

    out = tmp_path / "killed"
    killed = _launch(out, "--kill-at", "15")
    assert killed.returncode != 0 and (out / "killed").exists(), killed.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    resumed = _launch(out, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    ours, straight = _final(out), _final(runs / "dcir")
    assert ours.keys() == straight.keys() and all(torch.equal(ours[k], straight[k]) for k in ours)
    loaded = LlamaForCausalLM.from_pretrained(out / "final").state_dict()
    assert all(torch.equal(loaded[k], straight[k]) for k in straight)


@pytest.mark.slow
def test_bf16_is_the_engines_bf16(tmp_path):
    """bf16=True trains with the Engine's bf16 (bf16 compute and gathers, fp32 reduction and
    master weights, FSDP2's MixedPrecisionPolicy) where DDP runs under autocast: the
    logged losses agree to bf16's precision (1.2e-4 measured; DDP's own bf16 against its
    fp32 differs by 7e-5 on this script)."""
    for name, extra in (("dcir", ("--bf16",)), ("ddp", ("--stock", "--bf16"))):
        run = _launch(tmp_path / name, *extra)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ours, theirs = (json.loads((tmp_path / name / "log.json").read_text())["loss"] for name in ("dcir", "ddp"))
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(ours, theirs))
    assert worst <= 1e-3, (worst, ours, theirs)


def _error(call) -> str:
    with pytest.raises(dcir.DcirError) as e:
        call()
    return e.value.render()


def _trainer(tmp_path, dataset_size: int = 8, dcir_config=None, **args):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(dataset_size)]
    training = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[],
                                 disable_tqdm=True, use_cpu=True, **{"gradient_accumulation_steps": 2, **args})
    return DcirTrainer(model=model, args=training, train_dataset=data, dcir_config=dcir_config)


def test_a_world_accelerate_does_not_see(tmp_path):
    """Launched as 2 ranks on a machine without a GPU, TrainingArguments without use_cpu
    make each process a world of its own: every rank refuses to start."""
    script = tmp_path / "forgot_use_cpu.py"
    script.write_text("import sys, torch\n"
                      "from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments\n"
                      "from dcir_runtime.hf import DcirTrainer\n"
                      "import dcir\n"
                      "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
                      "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))\n"
                      "try:\n"
                      f"    DcirTrainer(model=model, args=TrainingArguments(output_dir={str(tmp_path / 'out')!r}, "
                      "report_to=[]))\n"
                      "except dcir.DcirError as e:\n"
                      "    print(e.render(), flush=True)\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(
        "error: DcirTrainer cannot honour these arguments:\n"
        "  TrainingArguments sees a world of 1 process(es) but 2 were launched (on a machine without a GPU, pass "
        "use_cpu=True so that accelerate joins them over gloo)") == 2, run.stdout


def test_arguments_it_cannot_honour(tmp_path):
    assert _error(lambda: _trainer(tmp_path, fsdp=True, torch_compile=True)) == (
        "error: DcirTrainer cannot honour these arguments:\n"
        "  TrainingArguments(fsdp=True): FSDP shards the model its own way: "
        "DcirTrainer shards it through DCIR; drop fsdp\n"
        "  TrainingArguments(torch_compile=True): the Engine compiles the step itself: drop torch_compile (the "
        "config's inductor compiles the compute between collectives)")
    assert _error(lambda: _trainer(tmp_path, max_steps=1, dcir_config={"gradient_accumulation_steps": 4}).train()) == (
        "error: dcir_config['gradient_accumulation_steps'] = 4 contradicts the TrainingArguments (2); give it in one "
        "place")
    assert _error(lambda: _trainer(tmp_path, dataset_size=6, max_steps=2).train()) == (
        "error: an epoch has 3 batches per rank, not a multiple of gradient_accumulation_steps 2: the Trainer would "
        "step early at each epoch's end, the Engine every 2 micro-steps; use a dataset (or dataloader_drop_last, "
        "max_steps) that fills each optimizer step")
    assert _error(lambda: EngineOptimizer(None).step(lambda: 0.0)) == (
        "error: the Engine's optimizer step takes no closure (LBFGS-style optimizers are not supported)")


def test_resuming_what_dcir_did_not_save(tmp_path):
    trainer = _trainer(tmp_path, max_steps=1)
    assert _error(lambda: trainer.train(resume_from_checkpoint=True)) == (
        f"error: resume_from_checkpoint=True: no complete checkpoint in {tmp_path / 'out'} (a checkpoint-N with "
        "trainer_state.json and the Engine's dcir/; found: none)")
    stock = tmp_path / "out" / "checkpoint-3"  # a stock Trainer's: weights and state, no Engine checkpoint
    stock.mkdir(parents=True)
    (stock / "trainer_state.json").write_text("{}")
    assert _error(lambda: trainer.train(resume_from_checkpoint=str(stock))) == (
        f"error: {stock} holds no DCIR Engine checkpoint (dcir/): it was not saved by DcirTrainer, or its save did "
        "not finish; start from its model with from_pretrained instead")


def test_accumulation_changed_under_the_engine(tmp_path):
    """The Engine counts the accumulation it was built with; a Trainer told another one
    afterwards would step the optimizer where the Engine does not."""
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.train()
    trainer.args.gradient_accumulation_steps = 1
    assert _error(lambda: trainer.train()) == (
        "error: the Trainer runs the optimizer after this micro-step and the Engine would not: their gradient "
        "accumulation disagrees (gradient_accumulation_steps changed after the Trainer was built?)")
