"""A hot-swap's recovery at 1K / 10K / 100K GPUs built from its parts, each labelled where it comes from, instead of a
curve fitted to 32 processes sharing 2 cores (``--scale-from``).

- detect: a lost node's agent heartbeat times out (``detect.node_timeout_s``): measured by bench/fleet.py (the real
  supervisor and store, simulated agents: loss -> failure event) at the fleet size nearest the GPU count, 8 GPUs a
  node; at a size beyond its data, the largest measured, labelled so.
- generation: the new generation reaches every rank (the supervisor's bump, the agents' relay): measured by
  bench/fleet.py up to its largest fleet, extrapolated beyond it by the least-squares line through its points.
- rank work: one rank's recovery (forming its own groups, the plan, its transfers, the first step), measured by
  bench/recovery_scale.py at its smallest N, where every rank has a core: by design it does not grow with the job
  (each rank connects its own groups' peers, waits on O(1) keys), which the per-rank table of that bench checks.
- central store: every rank's round trips to the control plane's one store in its recovery (the arrival, its pairs'
  addresses, the plan), served one at a time: N x a rank's round trips (measured by bench/recovery_scale.py, flat in
  N) / the store's requests a second (measured by bench/store_reads.py): extrapolated from those two measurements.
- NCCL communicators: PHOENIX re-forms a generation's communicators with torch 2.13 (``runtime/plane/groups.py``):
  on NCCL that includes the world communicator, whose init at scale is published, not measured here: ~265 s at
  96K GPUs for stock NCCL (NCCLX paper summary, ANCHORS.md [S61]); no published figure at 1K / 10K.
Beside them: the paper's trend (30 s at 512 GPUs, +4.3 s a doubling) and FT-HSDP's 3-minute stall at O(100K) [S34].
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .measurements import MEASURED_SCALE_FILE

FLEET_FILE = MEASURED_SCALE_FILE.parent / "fleet_latest.json"
STORE_FILE = MEASURED_SCALE_FILE.parent / "store_reads.json"
GPUS_PER_NODE = 8
NCCL_INIT_PUBLISHED = (96_000, 265.0, "published: stock NCCL communicator init ~265 s at 96K GPUs (NCCLX paper, ANCHORS.md S61)")
FT_HSDP_S = 180.0  # FT-HSDP (Meta): the stall at O(100K) GPUs, 10 min -> 3 min (ANCHORS.md S34)


def paper_trend(gpus: int) -> float:
    """The paper's recovery trend: 29.8 s at 512 GPUs, ~+4.3 s a doubling (17.1 s at 32-64)."""
    return 30.0 + 4.3 * math.log2(gpus / 512)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def parts_at(gpus: int, fleet: list[dict], scale: dict, store: dict | None = None) -> list[dict]:
    """The parts of one recovery at ``gpus`` GPUs (a rank each): name, seconds (None: no figure) and label. ``store``:
    bench/store_reads.py's measured rate (the central store's part). Pure."""
    nodes = max(1, math.ceil(gpus / GPUS_PER_NODE))
    rows = sorted((r for r in fleet if r.get("started") and r.get("propagate_s") is not None), key=lambda r: r["n"])
    out = []
    if rows:
        near = min(rows, key=lambda r: abs(math.log(r["n"]) - math.log(nodes)))
        close = abs(nodes - near["n"]) <= 0.1 * near["n"]
        out.append({"part": "detect (node heartbeat timeout, 10 s)", "s": near["detect_s"],
                    "label": f"measured (bench/fleet.py, {near['n']:,} nodes: flat in N, set by detect.node_timeout_s)"})
        if close:
            out.append({"part": "generation to every rank", "s": near["propagate_s"],
                        "label": f"measured (bench/fleet.py, {near['n']:,} nodes x 8 ranks, runs {near.get('runs', '?')})"})
        else:  # a power law through the fleet sizes measured (log-log least squares)
            a, b = _fit_line([math.log(r["n"]) for r in rows], [math.log(max(r["propagate_s"], 1e-6)) for r in rows])
            out.append({"part": "generation to every rank", "s": math.exp(a) * nodes ** b,
                        "label": f"extrapolated ({math.exp(a):.3g} x nodes^{b:.2f} through bench/fleet.py's {len(rows)} "
                                 f"fleet sizes, to {nodes:,} nodes)"})
    pts = sorted(scale.get("points", []), key=lambda p: p["ranks"])
    if pts:
        p = pts[0]
        out.append({"part": "rank work (own groups, plan, transfers, first step)", "s": p.get("total_s"),
                    "label": f"measured per rank (bench/recovery_scale.py at {p['ranks']} ranks, {p.get('commit', '?')}); "
                             "its parts that grow with N below"})
    out.extend(_grows_with_n(gpus, scale))
    out.extend(_central_store(gpus, pts, store or {}))
    g, s, label = NCCL_INIT_PUBLISHED
    out.append({"part": "NCCL world communicator (torch 2.13 re-forms it)", "s": s if gpus >= g * 0.5 else None,
                "label": label if gpus >= g * 0.5 else "not published at this size (NCCL issue #1156: '2.5 min above "
                "certain K GPUs'); 0 on gloo"})
    return out


def _central_store(gpus: int, pts: list[dict], store: dict) -> list[dict]:
    """The store's time serving every rank's recovery round trips: ``gpus`` x the most a rank made at any N measured
    (flat in N) / the store's measured rate. None of it is in the rank work measured at small N."""
    calls = max((p["store_calls"] for p in pts if p.get("store_calls")), default=None)
    rate = store.get("reads_per_s")
    if not calls or not rate:
        return []
    return [{"part": "central store (every rank's round trips, one by one)", "s": gpus * calls / rate,
             "label": f"extrapolated from two measurements: {gpus:,} ranks x {calls:g} round trips a rank (recovery_scale.py) "
                      f"/ {rate:,.0f} a second (store_reads.py, {store.get('commit', '?')})"}]


def _grows_with_n(gpus: int, scale: dict) -> list[dict]:
    """What of a rank's work depends on the job's size: the plan made up a tree of ranks (a level's merge of 16
    children's summaries, once per level of the tree, then the root's plan; from a bench of before the tree: the
    planner's plan over N descriptors, O(N)) and a rank's ring of its DP group (every rank, plain DP: the world,
    O(N)), measured in one process at 1K / 10K / 100K ranks by recovery_scale.py's pure parts; the size nearest
    ``gpus``, scaled to it."""
    rows = [r for r in scale.get("pure", []) if r.get("ranks")]
    if not rows:
        return []
    near = min(rows, key=lambda r: abs(math.log(r["ranks"]) - math.log(gpus)))
    f = gpus / near["ranks"]
    how = "measured" if abs(f - 1) <= 0.1 else f"scaled linearly from the measured {near['ranks']:,} ranks"
    if "depth" in near:  # the tree: its depth at ``gpus`` times a level's merge, plus the root's plan
        levels = tree_depth(gpus, near.get("fan", 16))
        plan = {"part": f"  of it, the plan up a tree of ranks ({levels} levels)", "s": levels * near["merge_s"] + near["root_plan_s"],
                "label": f"measured per level at {near['ranks']:,} ranks (recovery_scale.py's pure parts, one process; "
                         f"a rank reads {near['read_kb']:g} kB; the levels' store round trips are in the central store's part)"}
    else:
        plan = {"part": "  of it, the plan over N descriptors (one rank)", "s": near["plan_s"] * f,
                "label": f"{how} (recovery_scale.py's pure parts, one process; reading the descriptors' "
                         f"{near.get('descriptors_mb', 0) * f:.1f} MB from the store not included)"}
    return [plan, {"part": "  of it, a rank's ring of its DP group (plain DP)", "s": near["pairs_s"] * f,
                   "label": f"{how} (recovery_scale.py's pure parts, one process)"}]


def tree_depth(n: int, fan: int = 16) -> int:
    """The levels under the root of a tree of ``n`` ranks with ``fan`` children each (``exchange.tree_children``)."""
    depth, size = 0, 1
    while size < n:
        depth, size = depth + 1, size + fan ** (depth + 1)
    return depth


def load_store(path: Path = STORE_FILE) -> dict:
    """bench/data's store_reads.json ({} where missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load(fleet_path: Path = FLEET_FILE, scale_path: Path = MEASURED_SCALE_FILE) -> tuple[list[dict], dict]:
    """bench/data's fleet and recovery_scale files ([] / {} where missing or unreadable)."""
    def read(p: Path, empty):
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return empty
    fleet = read(fleet_path, {})
    return (fleet.get("rows", []) if isinstance(fleet, dict) else fleet), read(scale_path, {})


def table(sizes=(1_000, 10_000, 100_000), fleet: list[dict] | None = None, scale: dict | None = None,
          store: dict | None = None) -> list[dict]:
    """Per size: its parts, the total on gloo (measured and extrapolated parts only) and with NCCL's published init,
    the paper's trend and FT-HSDP's figure where it has one."""
    if fleet is None or scale is None:
        fleet, scale = load()
    store = load_store() if store is None else store
    out = []
    for g in sizes:
        parts = parts_at(g, fleet, scale, store)
        # the "  of it" rows: what N adds to the rank work measured at small N (where they are negligible)
        gloo = sum(p["s"] for p in parts if p["s"] is not None and not p["part"].startswith("NCCL"))
        nccl = next((p["s"] for p in parts if p["part"].startswith("NCCL")), None)
        out.append({"gpus": g, "parts": parts, "total_gloo_s": gloo, "total_nccl_s": None if nccl is None else gloo + nccl,
                    "paper_trend_s": paper_trend(g), "ft_hsdp_s": FT_HSDP_S if g >= 50_000 else None})
    return out


def render_lines(rows: list[dict]) -> list[str]:
    lines = ["Recovery built from its parts (each labelled; no curve fitted to the bench's 32 processes on 2 cores):"]
    for r in rows:
        lines.append(f"  {r['gpus']:>7,} GPUs: total {r['total_gloo_s']:.2f} s on the measured path"
                     + (f", {r['total_nccl_s']:.0f} s with NCCL's published world init" if r["total_nccl_s"] else "")
                     + f"; paper's trend {r['paper_trend_s']:.0f} s"
                     + (f"; FT-HSDP {r['ft_hsdp_s']:.0f} s" if r["ft_hsdp_s"] else ""))
        for p in r["parts"]:
            fig = f"{p['s']:.3f} s" if p["s"] is not None else "—"
            lines.append(f"      {p['part']:<52s} {fig:>10s}  {p['label']}")
    return lines
