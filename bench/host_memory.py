"""Host memory of a rank with protection on and off, against the protection's formula, at one state size.

    python bench/host_memory.py [--mb 512] [--steps 14]

Two jobs of examples/train_gpt.py (2 nodes x 2 ranks, the model bench/scale.py picks for ``--mb`` of state per
rank, the default configuration: no cadence raise, no recovery), one protected and one not, one after the other.
Prints each job's peak RSS over its ranks (sampled every 0.2 s), their difference, and the protection's formula
(the ``protection`` event's ``host_bytes``: two local snapshots and two slots of each replica held). What the
difference has beyond the formula is what protection holds that the formula does not count.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from scale import RANKS, PeakRss, shape_for

from common import GPT, env, events, phoenix


def peak(td: Path, name: str, d: int, layers: int, steps: int, protect: bool) -> tuple[int, dict]:
    cmd = phoenix("--nodes", RANKS // 2, "--nproc-per-node", 2, "--protect" if protect else "--no-protect",
                  "--run-dir", td / name, GPT, "--steps", steps, "--d-model", d, "--layers", layers, "--heads", 4,
                  "--seq", 16, "--batch", 1, "--dropout", 0.0)
    p = subprocess.Popen(cmd, cwd=td, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rss = PeakRss(p.pid)
    _, err = p.communicate(timeout=1800)
    top = rss.stop()
    if p.returncode != 0:
        raise SystemExit(f"host_memory.py: the {name} job failed ({p.returncode}): {err[-1500:]}")
    prot = next((e for e in events(td / name) if e["type"] == "protection"), {})
    return top, prot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=512)
    ap.add_argument("--steps", type=int, default=14)
    a = ap.parse_args()
    d, layers, state_mb = shape_for(a.mb)
    with tempfile.TemporaryDirectory() as td:
        on, prot = peak(Path(td), "on", d, layers, a.steps, True)
        off, _ = peak(Path(td), "off", d, layers, a.steps, False)
    formula = prot.get("host_bytes", 0)
    print(f"state per rank {state_mb:.1f} MB (d_model {d}, {layers} layers), {RANKS} ranks, {a.steps} steps")
    print(f"peak RSS of a rank: protection on {on / 1e6:.0f} MB, off {off / 1e6:.0f} MB; on - off {(on - off) / 1e6:.0f} MB; "
          f"the formula {formula / 1e6:.0f} MB; beyond it {(on - off - formula) / 1e6:+.0f} MB")


if __name__ == "__main__":
    main()
