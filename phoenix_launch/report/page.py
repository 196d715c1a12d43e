"""The report as one self-contained HTML page: inline CSS, charts as base64 PNG, no script, no network."""

from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any

from .cost import CostComparison
from .timeline import PHASES, Incident, Timeline, number

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
main{max-width:1060px;margin:0 auto;padding:24px}
h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d4da;padding-bottom:4px}
h3{font-size:15px;margin:0 0 6px}.sub{color:#5b6474;margin:0 0 16px}
.tiles{display:flex;flex-wrap:wrap;gap:10px}.tile{background:#fff;border:1px solid #d0d4da;border-radius:6px;padding:8px 14px;min-width:120px}
.tile b{display:block;font-size:20px}.tile span{color:#5b6474;font-size:12px}
.card{background:#fff;border:1px solid #d0d4da;border-left:5px solid #de2d26;border-radius:6px;padding:12px 16px;margin:10px 0}
.card.recovered{border-left-color:#31a354}.card.abandoned{border-left-color:#fdae6b}
table{border-collapse:collapse;margin:6px 0;font-size:13px}td,th{border:1px solid #d0d4da;padding:3px 8px;text-align:left}
th{background:#eef0f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;background:#fff;border:1px solid #d0d4da;border-radius:6px}
ul{margin:4px 0 8px 18px;padding:0}li{margin:2px 0}.muted{color:#5b6474;font-size:12px}code{font-size:12px}
"""
OUTCOME_WORDS = {
    "recovered": "recovered",
    "restarted": "restarted every worker",
    "stopped": "job stopped",
    "abandoned": "recovery superseded by the next failure",
    "no effect": "no effect observed",
    "open": "no decision recorded (the job ended first)",
}


def _fmt_bytes(n: Any) -> str:
    x = number(n)
    if x is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def _fmt_s(value: Any) -> str:
    x = number(value)
    if x is None:
        return "?"
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.3g} s" if x < 10 else f"{x:.1f} s"


def _img(data: str | None, alt: str) -> str:
    if not data:
        return f'<p class="muted">({escape(alt)}: nothing to show in this run)</p>'
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def describe_evidence(ev: dict[str, Any]) -> str:
    """One line for an ``injected`` or ``failure`` event."""
    node, kind = ev.get("node", "?"), ev.get("kind")
    if ev.get("type") == "injected":
        where = f" rank {ev['rank']}" if ev.get("rank") is not None else ""
        when = f" at step {ev['step']}" if ev.get("step") is not None else ""
        phase = f" ({ev['phase']})" if ev.get("phase") else ""
        src = f" by {ev['source']}" if ev.get("source") else ""
        return f"fault injected{src}: {ev.get('mode', '?')} on {node}{where}{when}{phase}"
    if kind == "rank_exit":
        msg = f": {ev.get('error') or ''} {ev.get('message') or ''}".rstrip() if ev.get("error") or ev.get("message") else ""
        return f"rank {ev.get('rank', '?')} on {node} (slot {ev.get('slot', '?')}) exited: {ev.get('exit', '?')}{msg}"
    if kind == "node_lost":
        return f"node {node} lost (agent {ev.get('agent_exit', '?')})"
    if kind == "hang":
        return f"rank on {node} slot {ev.get('slot', '?')} hung: silent {ev.get('silent_s', '?')} s at step {ev.get('step', '?')}"
    if kind == "heartbeat_lost":
        return f"node {node}: no heartbeat for {ev.get('silent_s', '?')} s"
    rest = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("v", "t", "type", "kind"))
    return f"{kind or ev.get('type')}: {rest}"


def _action_line(inc: Incident) -> str:
    parts = []
    for a in inc.actions:
        if a.get("type") == "hotswap":
            parts.append(f"hot-swap {a.get('failed', '?')} → {a.get('spare', '?')} (generation {a.get('gen', '?')}, "
                         f"{a.get('spares_left', '?')} spare(s) left)")
        elif a.get("type") == "local_recovery":
            parts.append(f"local recovery of {a.get('node', '?')} (generation {a.get('gen', '?')})")
        elif a.get("type") == "restart":
            parts.append(f"restart {a.get('attempt', '?')} of {a.get('max_restarts', '?')}")
        elif a.get("type") == "shrink":
            parts.append(f"shrink without {', '.join(a.get('lost') or []) or '?'}: DP {a.get('dp_from', '?')} → "
                         f"{a.get('dp_to', '?')} (generation {a.get('gen', '?')}, batch {a.get('elastic_batch', '?')})")
        elif a.get("type") == "grow":
            parts.append(f"grow back with {', '.join(a.get('joined') or []) or '?'}: DP {a.get('dp_from', '?')} → "
                         f"{a.get('dp_to', '?')} (generation {a.get('gen', '?')})")
        elif a.get("type") == "incident_closed":
            parts.append(str(a.get("why", "closed")))
    return escape("; ".join(parts) or "none")


def _incident_card(inc: Incident, tl: Timeline) -> str:
    dec = inc.decision or {}
    rec = inc.recovery
    at = inc.t_start - tl.t0
    step = inc.failure_step
    what = ("grow back (a spare became ready)" if dec.get("decision") == "grow" else
            f"{escape(inc.failure_class)} failure on {escape(', '.join(inc.nodes) or '?')}")
    title = (f"Incident {inc.number}: {what} at {at:.1f} s{f' (step {step})' if step is not None else ''}: "
             f"{OUTCOME_WORDS.get(inc.outcome, inc.outcome)}")
    rows = [
        "<li>" + escape(describe_evidence(e)) + "</li>" for e in inc.evidence
    ] or ["<li class='muted'>no failure event recorded</li>"]
    html = [f'<div class="card {escape(inc.outcome)}"><h3>{title}</h3>',
            "<b>Evidence</b><ul>" + "".join(rows) + "</ul>"]
    if dec:
        html.append(f"<b>Decision</b>: {escape(str(dec.get('decision', '?')))} (class {escape(str(dec.get('cls', '?')))}, "
                    f"action {escape(str(dec.get('action', '?')))})<br><span class='muted'>{escape(str(dec.get('reason', '')))}</span><br>")
    html.append(f"<b>Action</b>: {_action_line(inc)}")
    if rec:
        phases = inc.phases()
        cells = "".join(f"<td class='n'>{phases[label]:.3f}</td>" for _, label in PHASES) + f"<td class='n'>{phases['other']:.3f}</td>"
        html.append(
            f"<br><b>Recovery</b> ({escape(str(rec.get('path', '?')))}): {_fmt_s(rec.get('total_s'))} in all, resumed at step "
            f"{escape(str(rec.get('resume_step', '?')))}, {escape(str(rec.get('steps_replayed', '?')))} step(s) replayed"
            "<table><tr>" + "".join(f"<th>{label}</th>" for _, label in PHASES) + "<th>other</th></tr>"
            f"<tr>{cells}</tr></table><span class='muted'>seconds; 'other' is the rest of the total: settling the "
            "incident, deciding, waiting for the joiners</span>"
        )
    html.append("</div>")
    return "".join(html)


def _tiles(tl: Timeline) -> str:
    end = tl.end or {}
    recovered = sum(1 for i in tl.incidents if i.outcome == "recovered")
    items = [
        (str(end.get("state", "running or killed")), "final state"),
        (_fmt_s(tl.duration_s), "wall time"),
        (str(tl.last_step if tl.last_step is not None else "?"), "last step reported"),
        (str(len(tl.incidents)), "incidents"),
        (str(recovered), "recovered in memory"),
        (str(tl.counts.get("restart", 0)), "restarts"),
        (f"{tl.spares_used} / {tl.job.get('spares', '?')}", "spares used / at start"),
        (_fmt_s(tl.median_step_time()), "median step time"),
    ]
    dp = tl.dp_over_time()
    if dp:
        items.append((f"{dp[-1][1]} / {tl.dp_full} (min {min(n for _, n in dp)})", "DP at the end / full"))
    return '<div class="tiles">' + "".join(f"<div class='tile'><b>{escape(v)}</b><span>{escape(k)}</span></div>" for v, k in items) + "</div>"


def _resources(tl: Timeline, baseline_step_s: float | None) -> str:
    rep = {k: sum(1 for e in tl.replenish if e.get("type") == k) for k in ("replenish", "node_joined", "replenish_failed", "replenish_lost")}
    rows = [
        ("warm spares at start", tl.job.get("spares", "?")),
        ("spares used (hot-swap or restart)", tl.spares_used),
        ("spares lost while waiting", len(tl.spares_lost)),
        ("replenishments requested / joined", f"{rep['replenish']} / {rep['node_joined']}"),
        ("replenishments failed or lost", rep["replenish_failed"] + rep["replenish_lost"]),
    ]
    prot = [e for e in tl.protection if number(e.get("host_bytes")) is not None]
    if prot:
        peak = max(prot, key=lambda e: number(e["host_bytes"]))
        rows += [
            ("protection host memory, rank 0 (peak)", _fmt_bytes(peak["host_bytes"])),
            ("  of which optimizer / parameters", f"{_fmt_bytes(peak.get('optim_bytes'))} / {_fmt_bytes(peak.get('param_bytes'))}"),
            ("optimizer replicas (k)", peak.get("replicas", "?")),
        ]
    else:
        rows.append(("protection", "no protection events (protection off, or an older run)"))
    step = tl.median_step_time()
    if baseline_step_s and step:
        rows.append(("protection overhead on the step time", f"{(step / baseline_step_s - 1) * 100:+.1f} % "
                     f"({_fmt_s(step)} vs {_fmt_s(baseline_step_s)} in the baseline run)"))
    else:
        rows.append(("protection overhead on the step time", "not measured: give --baseline RUN_DIR, a run without protection"))
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows) + "</table>"


def _cost(cmp: CostComparison | None, chart: str | None) -> str:
    if cmp is None:
        return "<p>No incident was recovered in memory in this run (or it reported no step time): nothing to compare.</p>"
    rows = "".join(
        f"<tr><td>#{i.number}</td><td class='n'>{'?' if i.step is None else i.step}</td><td class='n'>{i.phoenix_s:.2f}</td>"
        f"<td class='n'>{i.ckpt_s:.1f}</td><td class='n'>{i.ckpt_s - i.phoenix_s:.1f}</td></tr>"
        for i in cmp.incidents
    )
    total = (f"<tr><th>all</th><td></td><td class='n'>{cmp.phoenix_total_s:.2f}</td><td class='n'>{cmp.ckpt_total_s:.1f}</td>"
             f"<td class='n'>{cmp.ckpt_total_s - cmp.phoenix_total_s:.1f}</td></tr>")
    assumptions = "".join(f"<li>{escape(a)}</li>" for a in cmp.assumptions) or "<li>none: every input is this run's or yours</li>"
    return (
        f"<p>Inputs: t_step = {cmp.step_time_s:.4g} s (median of this run's progress events unless stated), "
        f"K = {cmp.ckpt_every} steps, T_restart = {_fmt_s(cmp.restart_s)}. Assumed, not measured:</p><ul>{assumptions}</ul>"
        "<table><tr><th>incident</th><th>failed at step</th><th>PHOENIX lost (s, measured)</th>"
        "<th>checkpoint-restart would lose (s, model)</th><th>saved (s)</th></tr>" + rows + total + "</table>"
        "<p class='muted'>PHOENIX: the recovery's total time (from the fault) plus the steps it replayed. "
        "Checkpoint-restart: T_restart + (step mod K) complete steps replayed since the last checkpoint + the "
        f"interrupted step. Expected per failure (simulator, eq. 2 and eq. 5): checkpoint-restart {_fmt_s(cmp.expected_ckpt_s)}, "
        f"PHOENIX {_fmt_s(cmp.expected_phoenix_s)}.</p>" + _img(chart, "time lost per incident")
    )


def _dp_section(tl: Timeline, chart: str | None) -> str:
    """The data-parallel size over time (shrinks and grows, ``launch.on_no_spare``): a chart and a table."""
    if not tl.resizes:
        return "<p>Unchanged: the job never shrank (no <code>shrink</code> or <code>grow</code> event).</p>"
    rows = "".join(
        f"<tr><td class='n'>{max(0.0, float(e['t']) - tl.t0):.1f}</td><td>{escape(str(e.get('type')))}</td>"
        f"<td class='n'>{escape(str(e.get('dp_from', '?')))} → {escape(str(e.get('dp_to', '?')))}</td>"
        f"<td>{escape(', '.join(e.get('lost') or e.get('joined') or []) or '?')}</td>"
        f"<td class='n'>{escape(str(e.get('gen', '?')))}</td><td class='n'>{escape(str(e.get('resume_step', '?')))}</td>"
        f"<td class='n'>{_fmt_s(e.get('cost_s')) if e.get('cost_s') is not None else 'none recorded'}</td></tr>"
        for e in tl.resizes)
    shrunk = sum(b[0] - a[0] for a, b in zip(tl.dp_over_time(), tl.dp_over_time()[1:]) if a[1] < (tl.dp_full or 0))
    return (_img(chart, "data-parallel size") +
            "<table><tr><th>at (s)</th><th>event</th><th>DP</th><th>nodes lost / joined</th><th>generation</th>"
            "<th>resumed at step</th><th>cost</th></tr>" + rows + "</table>"
            f"<p class='muted'>Full DP {tl.dp_full}; shrunk for {_fmt_s(shrunk)} of the run. Cost: the recovery's "
            "total, from the fault (a shrink) or the decision (a grow) to the first step after it.</p>")


def describe_corruption(ev: dict[str, Any]) -> str:
    """One line for an ``sdc_detected``, ``sdc_repaired`` or ``copy_corrupt`` event (silent data corruption)."""
    kind = ev.get("type")
    if kind == "copy_corrupt":
        return (f"{ev.get('kind', '?')} held by rank {ev.get('rank', '?')} on {ev.get('node', '?')} changed at rest "
                f"({ev.get('owner', '?')}, step {ev.get('step', '?')}): {ev.get('reason', '')}")
    ranks = ev.get("ranks") or []
    who = f"rank(s) {ranks} on {', '.join(ev.get('nodes') or []) or '?'}" if ranks else "undecided"
    what = f", tensors {', '.join(ev.get('tensors') or [])}" if ev.get("tensors") else ""
    if kind == "sdc_repaired":
        return f"repaired ({ev.get('decision', '?')}): {who}, resumed at step {ev.get('resumed_at', '?')}"
    return (f"fingerprints disagree at step {ev.get('step', '?')}: {who}{what}; last agreed step "
            f"{ev.get('last_agreed', '?')} ({ev.get('reason', '')})")


def _corruption(tl: Timeline) -> str:
    if not tl.corruption:
        return ("<p>None found: no commit point's fingerprints disagreed and no held copy changed at rest (what is "
                "covered: docs/runtime.md).</p>")
    rows = "".join(f"<li>{max(0.0, float(e.get('t', tl.t0)) - tl.t0):.1f} s: {escape(describe_corruption(e))}</li>"
                   for e in tl.corruption)
    return f"<ul>{rows}</ul>"


def _jobs(tl: Timeline) -> str:
    """The jobs of a chain (allocations ended by a signal or a time limit, each resumed): when each ran, how it
    ended, what it saved from memory, where the next one resumed."""
    if len(tl.jobs) < 2:
        return ""
    rows = []
    for n, j in enumerate(tl.jobs, 1):
        s, e = j["start"], j["end"] or {}
        began = f"{(float(s['t']) - tl.t0) / 3600:.2f} h"
        resumed = f"from step {s['resume'].rsplit('_', 1)[-1].lstrip('0') or '0'}" if s.get("resume") else "from scratch"
        ended = (f"exit {e.get('exit_code')}: {e.get('reason', '')}" if e else "killed (no job_end)")
        saved = f"; saved step {j['saved']} from memory" if j["saved"] is not None else ""
        rows.append(f"<tr><td>{n}</td><td>{escape(began)}</td><td>{escape(resumed)}</td><td>{escape(ended + saved)}</td></tr>")
    return (f"<h2>Jobs in this run directory ({len(tl.jobs)})</h2><table><tr><th>#</th><th>started at</th><th>began</th>"
            f"<th>ended</th></tr>{''.join(rows)}</table>")


def render_page(tl: Timeline, charts: dict[str, str | None], cmp: CostComparison | None,
                baseline_step_s: float | None = None) -> str:
    job = tl.job
    started = dt.datetime.fromtimestamp(tl.t0, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if tl.t0 else "?"
    shape = f"{job.get('nodes', '?')} node(s) x {job.get('nproc_per_node', '?')} rank(s) + {job.get('spares', '?')} spare(s)"
    end = tl.end or {}
    reason = f" &mdash; {escape(str(end.get('reason')))}" if end.get("reason") else ""
    incidents = "".join(_incident_card(i, tl) for i in tl.incidents) or "<p>No failure in this run.</p>"
    stops = [j for j in tl.jobs if j["end"] is None or j["end"].get("exit_code") != 0]
    if not tl.incidents and len(tl.jobs) > 1 and stops:
        incidents = f"<p>No failure in this run; it was stopped {len(stops)} time(s) and resumed (below).</p>"
    skipped = f"; {tl.skipped_lines} unreadable line(s) skipped" if tl.skipped_lines else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>PHOENIX report: {escape(str(job.get('run_id', '?')))}</title>
<style>{CSS}</style></head><body><main>
<h1>PHOENIX run {escape(str(job.get('run_id', '?')))}</h1>
<p class="sub">{escape(shape)}, backend {escape(str(job.get('backend', '?')))}, started {started}; exit code {escape(str(end.get('exit_code', '?')))}{reason}</p>
{_tiles(tl)}
<h2>Step time and throughput</h2>{_img(charts.get('progress'), 'step time and throughput')}
<h2>Incidents ({len(tl.incidents)})</h2>{_img(charts.get('phases'), 'recovery phases')}{incidents}
{_jobs(tl)}<h2>Silent data corruption</h2>{_corruption(tl)}
<h2>Data-parallel size</h2>{_dp_section(tl, charts.get('dp'))}
<h2>Node states</h2>{_img(charts.get('nodes'), 'node states')}
<h2>Spares and protection</h2>{_img(charts.get('resources'), 'spares and host memory')}{_resources(tl, baseline_step_s)}
<h2>Work lost against checkpoint-restart</h2>{_cost(cmp, charts.get('cost'))}
<p class="muted">From {sum(tl.counts.values())} events in events.jsonl{skipped}. Generated by phoenix-run report.</p>
</main></body></html>
"""
