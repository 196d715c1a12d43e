"""Issue 32: the FSDP2 idiom of pytorch/examples and torchtitan (a model built on the meta device, sharded by the
user's ``parallelize``, materialised with ``to_empty`` and initialised on its shards) survives a hot-swap.

Real jobs: examples/fsdp2_meta.py on 2 nodes x 2 ranks + 1 spare, node1 SIGKILLed mid-run; each ends with the
failure-free run's digest (computed once per layout in this module). One process with a fake process group:
a joiner's local apply of a meta model allocates its local shards only, never a full tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES, assert_same_digest, check_resume_steps, events, job_processes, load_digest, of_type, run_phoenix, scripts_env

STEPS = 10
SCRIPT = str(EXAMPLES / "fsdp2_meta.py")
LAYOUTS = {"fsdp": ["--mesh", "fsdp"], "hsdp": ["--mesh", "hsdp"], "tp": ["--mesh", "tp"],
           "fsdp-mp": ["--mesh", "fsdp", "--mixed-precision"], "hsdp-mp": ["--mesh", "hsdp", "--mixed-precision"]}


def run_job(d: Path, layout: str, spares: int, faults=(), extra=()):
    d.mkdir()
    cfg = {"inject": {"faults": list(faults)}, "runtime": {"replicas": 1}, "detect": {"recovery_timeout_s": 90}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    digest = d / "digest.json"
    r = run_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "2", "--spares", str(spares),
                     "--run-dir", str(d / "run"), SCRIPT, "--steps", str(STEPS), "--digest-file", str(digest),
                     *LAYOUTS[layout], *extra], d, timeout=360)
    return r, d / "run", digest


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cache = {}

    def get(layout):
        if layout not in cache:
            r, _, dg = run_job(tmp_path_factory.mktemp("base") / layout, layout, 0)
            assert r.returncode == 0, r.stderr[-3000:]
            cache[layout] = load_digest(dg, f"failure-free {layout} run")  # fails when missing
        return cache[layout]

    return get


def rows():
    """(layout, fault step, extra flags); CI runs FSDP2, the rest is ``full`` (HSDP loses a node in test_fsdp.py)."""
    full = [("hsdp-mp", 5, ()), ("hsdp", 5, ()), ("fsdp-mp", 5, ()), ("tp", 5, ()), ("fsdp", 0, ("--init-weights",))]
    return [pytest.param("fsdp", 5, (), id="fsdp")] + [
        pytest.param(*v, marks=[pytest.mark.full], id=f"{v[0]}-step{v[1]}{''.join(v[2])}") for v in full]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,step,extra", rows())
def test_meta_model_is_hot_swapped_bit_identically(tmp_path, baseline, layout, step, extra):
    """node1 (ranks 2, 3) is SIGKILLed in the forward of ``step``; the spare's ranks parallelise the meta model
    locally and take their state from the recovery (at step 0: their own fresh shards, the lost ones'; or
    the supervisor starts every worker fresh with the spare, nothing being done yet).
    ``--init-weights``: parallelize only shards; PHOENIX materialises and calls the model's init_weights()."""
    r, run_dir, dg = run_job(tmp_path / "job", layout, 1, [{"node": "node1", "step": step, "mode": "crash", "phase": "forward"}], extra)
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(run_dir)
    assert_same_digest(dg, baseline(layout))  # fails when the digest file is missing
    assert not job_processes(run_dir)
    log = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    assert ("forward in torch.bfloat16" in log) == layout.endswith("-mp")  # the policy is in force
    if step == 0 and not of_type(evs, "hotswap"):
        # nothing completed yet: the supervisor may start every worker fresh with the spare instead of a
        # hot-swap (decide._fresh_start, raced with the ranks' first heartbeats); the digest holds either way
        assert [(d["decision"], d.get("spare")) for d in of_type(evs, "decision")][:1] == [("restart", "node2")], of_type(evs, "decision")
        return
    assert of_type(evs, "recovery"), [e["type"] for e in evs]
    check_resume_steps(evs)
    swap = of_type(evs, "hotswap")[0]
    assert (swap["failed"], swap["spare"]) == ("node1", "node2")
    assert "generation 1: resumed at step" in log  # a survivor: kept its process
    assert ("fresh [2, 3]" in log) == (step == 0 and not layout.startswith("hsdp"))

LOCAL_APPLY = r'''
import json, torch, torch.nn as nn
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.fsdp import fully_shard
from largest_tensor import Largest  # tests/scripts, on the path
from phoenix_runtime.parallel import Parallel, local_of
from phoenix_runtime.errors import UsageError
dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)  # rank 2 of 4: no peer runs

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)
    def reset_parameters(self):
        self.a.reset_parameters()
        self.b.reset_parameters()

def fn(m, mesh):
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh)

out = {}
for kind in ("meta", "cpu"):
    torch.manual_seed(0)
    with torch.device(kind):
        m = Net()
    with Largest() as mode:
        Parallel.create(fn, {"shard": 4}, m, 4, "cpu").apply(m, 0, local=True)
    out[kind] = {"largest": mode.n, "on_meta": [local_of(p).is_meta for p in m.parameters()],
                 "shards": [local_of(p).numel() for p in m.parameters()],
                 "std": float(local_of(m.a.weight).std()), "max": float(local_of(m.a.weight).abs().max())}
with torch.device("meta"):
    bare = nn.Sequential(nn.Linear(4, 4))
try:
    Parallel.create(lambda m, mesh: fully_shard(m, mesh=mesh), {"shard": 4}, bare, 4, "cpu").apply(bare, 0, local=True)
except UsageError as e:
    out["refused"] = str(e)
print("OUT:" + json.dumps(out))
'''


@pytest.mark.timeout(120)
def test_a_joiners_local_apply_of_a_meta_model_allocates_only_its_shards(tmp_path):
    """A joiner (rank 2 of 4, alone: a fake process group) applies FSDP2 to a model built on meta: it is
    materialised and initialised by its reset_parameters(), and no tensor larger than a local shard is ever
    made; the same apply on a materialised model cuts its shards from the full tensors (the measure sees them).
    A meta model left on meta by parallelize without init_weights()/reset_parameters() is refused, saying how."""
    r = subprocess.run([sys.executable, "-c", LOCAL_APPLY], cwd=tmp_path, env=scripts_env(),
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("OUT:"))[len("OUT:"):])
    meta, full = out["meta"], out["cpu"]
    assert meta["shards"] == full["shards"] == [64 * 256 // 4, 256 // 4, 256 * 64 // 4, 64 // 4]
    # materialised and initialised: Linear(64, 256)'s reset_parameters draws U(-1/8, 1/8), std 1/8/sqrt(3)
    assert not any(meta["on_meta"]) and meta["max"] <= 0.125 and 0.06 < meta["std"] < 0.085, meta
    assert meta["largest"] == max(meta["shards"]) < 64 * 256
    assert full["largest"] == 64 * 256  # the full weight of the materialised model: the measure can fail
    assert "on the meta device after parallelize" in out["refused"] and "to_empty" in out["refused"]
