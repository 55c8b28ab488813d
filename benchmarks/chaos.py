"""Faults survived: a chaos run of the main job under ``torchrun --max-restarts``.

    python benchmarks/chaos.py                  # 20 faults; the table, chaos.json
    python benchmarks/chaos.py --faults 5       # one of each kind (the slow test's run)

``dcir-train`` (a ``transformers`` Llama from a config, ZeRO-3, AdamW) runs under
``torchrun --standalone --max-restarts N`` with ``--save-every`` and ``--resume``, and an
injector outside the job breaks it, one fault at a time, at random moments while it
trains. Each fault is one of:

* ``kill``: SIGKILL a random rank;
* ``stop``: SIGSTOP a random rank until the others' collective has timed out (the
  config's ``timeout_s``, then 1.5 s more), then SIGCONT it, as a stall that ends too late;
* ``disk``: an ``RLIMIT_FSIZE`` of 4 KiB on a random rank (``prlimit``): its next
  checkpoint file cannot be written, as on a full disk; the save fails on every rank;
* ``corrupt``: SIGKILL a random rank and, once the job's processes are gone, flip one
  byte of the newest complete checkpoint's largest file: the restarted job must find
  the damage and resume from the checkpoint before;
* ``world``: stop the job and start it again at another world size (2 <-> 3, with the
  global batch kept: 3 x 2 sequences, or 2 x 3), from its newest checkpoint.

The four kinds come in shuffled rounds, then the world change, late in the run (40 steps
before its end, or 25 without faults after it), then (from 7 faults on) a kill and a
stall at the new world size. After every fault the job must resume from
its newest complete checkpoint (torchrun restarts it, or the injector does for
``world``). The checkpoints are kept 3 deep (``--keep-last 3``). At the end:

* the newest checkpoint before the world change equals the uninterrupted run's of the
  same step, bit for bit;
* the final parameters equal, bit for bit, those of a faultless run started from that
  checkpoint at the new world size;
* and they are within ``--tolerance`` of the uninterrupted run's (every tensor's
  difference relative to its norm; the world size changes the order of the sums).

The report lists every fault: its target and the step the progress bar had reached
(it lags a step at most), how it was detected (the first failure line the job printed)
and after how long, how long until the job had resumed (its "resumed from" line), from
which checkpoint, how many steps were redone, and for ``corrupt`` the fallback the load
announced.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KINDS = ("kill", "stop", "disk", "corrupt")
JOB = ["--layers", "2", "--hidden", "128", "--seq", "64", "--lr", "1e-3"]
GLOBAL_BATCH = 6  # sequences per optimizer step: 2 ranks x 3 or 3 ranks x 2
DETECTED = re.compile(r"^(dcir-train: (?!resumed from|no complete)|error: |.*RankFailure|\[rank\d+\]: \w*Error"
                      r"|.*torch.distributed.elastic.*(failed|FAILED))")
RESUMED = re.compile(r"dcir-train: (resumed from (\S+) at step (\d+)|no complete checkpoint)")
BAR = re.compile(r"^.*?\| *(\d+)/(\d+) \[[^\]]*\]")  # tqdm's line; what follows it is the next output


class Job:
    """One ``torchrun`` launch of ``dcir-train``; its output read line by line (the
    progress bar's ``\\r`` updates too), each line timestamped."""

    def __init__(self, world: int, ns, ckpt: Path, log, keep: int | None = 3):
        self.world, self.lines, self.step = world, [], 0
        ckpt.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "--max-restarts", str(ns.faults + 5), "--monitor-interval", "0.1",
               "-m", "dcir_runtime.train", *JOB, "--steps", str(ns.steps), "--batch", str(GLOBAL_BATCH // world),
               "--save-every", str(ns.save_every), *(["--keep-last", str(keep)] if keep else []),
               "--checkpoint-dir", str(ckpt), "--resume", str(ckpt), "--config", json.dumps({"timeout_s": ns.timeout})]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               # the agent's shared store hands restarted workers the dead ones' gloo addresses
               # now and then (pytorch/pytorch#135712): not shared, it does not
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     cwd=ckpt.parent, start_new_session=True)
        self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.reader.start()

    def _read(self, log) -> None:
        buffer = b""
        while chunk := self.proc.stdout.read1(65536):
            buffer += chunk
            *done, buffer = re.split(rb"[\r\n]", buffer)
            for raw in done:
                self._line(raw.decode(errors="replace"), log)
        if buffer:
            self._line(buffer.decode(errors="replace"), log)

    def _line(self, text: str, log) -> None:
        if not text.strip():
            return
        bar = BAR.search(text)
        if bar:  # a progress bar's update, with no newline before what a rank prints next
            self.step = int(bar[1])
            text = text[bar.end():]
            if not text.strip():
                return
        now = time.time()
        self.lines.append((now, text))
        log.write(f"{now:.3f} {text}\n")
        log.flush()

    def first(self, pattern: re.Pattern, since: float, timeout: float):
        """The first line matching ``pattern`` printed after ``since``: (time, match), or None."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for t, text in list(self.lines):
                if t >= since and (m := pattern.search(text)):
                    return t, m
            if self.proc.poll() is not None and not self.reader.is_alive():
                return None
            time.sleep(0.02)
        return None

    def workers(self) -> dict[int, int]:
        """rank -> pid of the job's current worker processes (the agent's children)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
            except (OSError, ValueError, IndexError):
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = int(entry.name)
        return found

    def stop(self) -> None:
        """Ends the whole job (the agent stops its workers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reader.join(10)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"chaos: {what} did not happen within {timeout:.0f} s")


def _complete(ckpt: Path) -> list[Path]:
    """The complete checkpoints in ``ckpt``, oldest first."""
    from dcir_runtime.checkpoint import MARKER, _step_of  # noqa: PLC2701 (the step a marker records)

    done = [d for d in ckpt.iterdir() if d.is_dir() and ".tmp-" not in d.name and (d / MARKER).is_file()]
    return sorted(done, key=_step_of)


def _corrupt(path: Path) -> str:
    """Flips one byte in the middle of the checkpoint's largest data file; its name."""
    target = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"{path.name}/{target.name}"


def _inject(job: Job, kind: str, ckpt: Path, rng: random.Random) -> dict:
    """Breaks the running job; what was done, and when."""
    workers = _wait_for(lambda: (w := job.workers()) and len(w) == job.world and w, 60, "the job's workers")
    rank = rng.randrange(job.world)
    pid = workers[rank]
    record = {"kind": kind, "rank": rank, "step": job.step, "at": time.time()}
    if kind == "kill" or kind == "corrupt":
        os.kill(pid, signal.SIGKILL)
    elif kind == "stop":
        os.kill(pid, signal.SIGSTOP)
        record["stopped"] = pid
    elif kind == "disk":
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        record["latest_before"] = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    if kind == "corrupt":  # once no process of that generation can commit a save any more
        _wait_for(lambda: not (set(job.workers().values()) & set(workers.values())), 60, "the workers' exit")
        record["corrupted"] = _corrupt(_complete(ckpt)[-1])
    return record


def _follow(job: Job, record: dict, ckpt: Path, timeout: float, stall: float) -> None:
    """Waits for the fault's detection and the job's resume; fills in the record."""
    since = record["at"]
    if "stopped" in record:  # the stall ends after the others' timeout
        time.sleep(max(0.0, since + stall - time.time()))
        try:
            os.kill(record.pop("stopped"), signal.SIGCONT)
        except ProcessLookupError:
            pass
    seen = job.first(DETECTED, since, timeout) if record["kind"] != "world" else None
    if seen:
        record["detected_s"] = round(seen[0] - since, 3)
        record["detected_by"] = seen[1].string.strip()[:600]
    resumed = job.first(RESUMED, since, timeout)
    if resumed is None:
        raise RuntimeError(f"chaos: the job did not resume after {record['kind']} (see the log)")
    record["recovered_s"] = round(resumed[0] - since, 3)
    record["resumed_from"] = Path(resumed[1][2]).name if resumed[1][2] else None
    record["redone"] = max(0, record["step"] - int(resumed[1][3] or 0))
    fell_back = [text for t, text in job.lines if t >= since and "is damaged" in text]
    record["fell_back"] = fell_back[0].strip()[:300] if fell_back else None
    if record["kind"] == "disk":
        record["leftovers"] = sorted(p.name for p in ckpt.iterdir() if ".tmp-" in p.name)


def _plan(ns, rng: random.Random) -> list[str]:
    """The faults in order: the four kinds shuffled in rounds at one world size, then a
    world change, then (from 7 faults on) a kill and a stall at the other world size."""
    tail = ["kill", "stop"] if ns.faults >= 7 else []
    head = []
    while len(head) < ns.faults - 1 - len(tail):
        head += rng.sample(KINDS, len(KINDS))
    return head[:ns.faults - 1 - len(tail)] + ["world"] + tail


def _exported(ckpt: Path, tag: str, out: Path) -> dict:
    """A checkpoint's parameters, whole (``dcir_runtime.checkpoint.export``)."""
    from safetensors.torch import load_file

    from dcir_runtime.checkpoint import export

    return load_file(str(export(ckpt, out / tag, tag)))


def _compare(a: dict, b: dict) -> dict:
    """Bit for bit, and the largest differences: of one element relative to its tensor's
    largest, and of a tensor's norm relative to its norm."""
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return {"bitwise_equal": all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_relative": max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item()
                                    for k in a),
            "norm_relative": max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in a)}


def _run_chaos(ns, work: Path, log) -> tuple[list[dict], dict | None, str]:
    """The job under faults; the fault records, the newest checkpoint before the world
    change (exported), and the final checkpoint's tag."""
    rng = random.Random(ns.seed)
    ckpt = work / "chaos"
    job, records, before_change = Job(ns.world, ns, ckpt, log), [], None
    for i, kind in enumerate(_plan(ns, rng)):
        start = job.step
        _wait_for(lambda: job.step >= start + 2 or job.proc.poll() is not None, 300, "progress")
        if kind == "corrupt" and len(_complete(ckpt)) < 2:
            kind = "kill"  # nothing older to fall back to yet
        time.sleep(rng.uniform(0, 0.3))
        if job.proc.poll() is not None:
            raise RuntimeError(f"chaos: the job ended before fault {i + 1} (use more --steps)")
        if kind == "world":  # late, so that the steps at the new world size, whose sums run in another order, are few
            reserve = 40 if i + 1 < ns.faults else 25  # the faults after it need steps too
            _wait_for(lambda: job.step >= ns.steps - reserve or job.proc.poll() is not None, 600, "progress")
            record = {"kind": "world", "rank": None, "step": job.step, "at": time.time()}
            job.stop()
            newest = _complete(ckpt)[-1].name
            before_change = {"tag": newest, "params": _exported(ckpt, newest, work / "before-change"),
                             "world": 5 - job.world}
            shutil.copytree(ckpt / newest, work / "branch" / newest)  # where the faultless branch starts
            record["world"] = f"{job.world} -> {5 - job.world}"
            record["at"] = time.time()
            job = Job(5 - job.world, ns, ckpt, log)
        else:
            record = _inject(job, kind, ckpt, rng)
        _follow(job, record, ckpt, 180, stall=ns.timeout + 1.5)
        records.append(record)
        print(f"fault {i + 1:>2}/{ns.faults}: {_row(record)}", flush=True)
    if job.proc.wait(ns.steps * 5 + 300) != 0:
        raise RuntimeError(f"chaos: the job failed after the last fault (exit {job.proc.returncode})")
    job.reader.join(10)
    return records, before_change, _complete(ckpt)[-1].name


def _row(r: dict) -> str:
    what = {"kill": "SIGKILL", "stop": "SIGSTOP", "disk": "RLIMIT_FSIZE", "corrupt": "SIGKILL + corrupt",
            "world": "restart at another world"}[r["kind"]]
    target = f"rank {r['rank']}" if r["rank"] is not None else r.get("world", "")
    detected = (f"{r['detected_s']:.2f} s: {r['detected_by'][:90]}" if "detected_s" in r else "planned")
    return (f"{what:<26}{target:<10} step {r['step']:>4}  detected {detected}  resumed in {r['recovered_s']:.1f} s "
            f"from {r['resumed_from']}, {r['redone']} step(s) redone"
            + (f"; fell back: {r['fell_back'][:160]}" if r.get("fell_back") else "")
            + (f"; leftovers {r['leftovers']}" if r.get("leftovers") else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chaos.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=20, help="faults to inject (default 20; at least 5)")
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps of the job (default 250)")
    ap.add_argument("--world", type=int, default=2, choices=(2, 3), help="the world size it starts at (default 2)")
    ap.add_argument("--save-every", type=int, default=5, help="dcir-train --save-every (default 5)")
    ap.add_argument("--timeout", type=float, default=3.0, help="the engine's timeout_s (default 3)")
    ap.add_argument("--tolerance", type=float, default=1e-6,
                    help="the largest difference of a final parameter tensor from the uninterrupted run's, relative "
                         "to its norm, allowed after the world change (default 1e-6)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the faults' order, targets and moments")
    ap.add_argument("--out", default="chaos.json", help="the report (default chaos.json)")
    ap.add_argument("--work", default=None,
                    help="a directory for the checkpoints and the log (default: a temporary one)")
    ns = ap.parse_args(argv)
    if ns.faults < 5:
        ap.error("--faults: at least 5 (one of each kind)")
    work = Path(ns.work or tempfile.mkdtemp(prefix="dcir-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    begin = time.time()
    with open(work / "job.log", "w") as log:
        reference = Job(ns.world, ns, work / "reference", log, keep=None)
        if reference.proc.wait(ns.steps * 5 + 300) != 0:
            print(f"chaos: the uninterrupted run failed; see {work / 'job.log'}", file=sys.stderr)
            return 1
        records, before, final = _run_chaos(ns, work, log)
        report = _report(ns, work, records, before, final, time.time() - begin, log)
    Path(ns.out).write_text(json.dumps(report, indent=1))
    print(f"\nthe report: {ns.out}; the job's output: {work / 'job.log'}")
    return 0 if report["ok"] else 1


def _report(ns, work: Path, records: list[dict], before: dict | None, final: str, wall: float, log) -> dict:
    """The three comparisons: before the world change, the chaos run's newest checkpoint
    against the uninterrupted run's of the same step (bit for bit); at the end, against a
    faultless run from that checkpoint at the new world size (bit for bit) and against the
    uninterrupted run (within the tolerance: the world size changes the sums' order)."""
    chaos, ref = _exported(work / "chaos", final, work / "final-chaos"), _exported(work / "reference", final,
                                                                                   work / "final-ref")
    checks = {"final_vs_uninterrupted": _compare(chaos, ref)}
    ok = checks["final_vs_uninterrupted"]["norm_relative"] <= ns.tolerance
    if before is not None:
        checks["before_change_vs_uninterrupted"] = {"tag": before["tag"], **_compare(
            before["params"], _exported(work / "reference", before["tag"], work / "before-ref"))}
        (work / "branch" / "latest").write_text(before["tag"] + "\n")
        branch = Job(before["world"], ns, work / "branch", log, keep=None)
        if branch.proc.wait(ns.steps * 5 + 300) != 0:
            raise RuntimeError("chaos: the faultless branch after the world change failed (see the log)")
        checks["final_vs_faultless_branch"] = _compare(chaos, _exported(work / "branch", final, work / "final-branch"))
        ok = ok and checks["before_change_vs_uninterrupted"]["bitwise_equal"] and \
            checks["final_vs_faultless_branch"]["bitwise_equal"]
    print(f"\n{len(records)} faults in {wall:.0f} s; final checkpoint {final}:")
    for name, c in checks.items():
        print(f"  {name.replace('_', ' '):<34} bit for bit {str(c['bitwise_equal']):<6} largest element difference "
              f"{c['max_abs_relative']:.3g}, largest norm difference {c['norm_relative']:.3g} (relative)")
    print(f"allowed against the uninterrupted run: {ns.tolerance:g} of a tensor's norm; {'OK' if ok else 'FAILED'}")
    return {"faults": records, "final": final, "checks": checks, "wall_s": wall, "ok": ok, "args": vars(ns)}


if __name__ == "__main__":
    sys.exit(main())
