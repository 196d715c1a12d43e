"""The architecture's rules hold on the tree: sizes, no import cycle, no import from the runtime into the launcher."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_archcheck_passes():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(ROOT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("no upward import")


def test_archcheck_refuses_an_add_on_in_the_core(tmp_path):
    """The core never imports the add-ons; the CLI's subcommands do, inside a function."""
    for rel, src in {"runtime/__init__.py": "", "phoenix_launch/__init__.py": "",
                     "phoenix_launch/simulate/__init__.py": "", "phoenix_launch/report/__init__.py": "",
                     "phoenix_launch/report/cost.py": "from phoenix_launch.simulate import x\n",
                     "phoenix_launch/cli.py": "def report():\n    from phoenix_launch.report import cost\n",
                     "phoenix_launch/observe/status.py": "from phoenix_launch import report\n",
                     "phoenix_launch/observe/ui.py": "def f():\n    import phoenix_launch.simulate\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in r.stdout.splitlines() if line.startswith("core imports add-on")]
    assert r.returncode == 1 and sorted(problems) == ["core imports add-on phoenix_launch.report from phoenix_launch.observe.status:1",
                                                      "core imports add-on phoenix_launch.simulate from phoenix_launch.observe.ui:2"], r.stdout
    (tmp_path / "phoenix_launch/cli.py").write_text("from phoenix_launch.report import cost\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "core imports add-on phoenix_launch.report.cost from phoenix_launch.cli:1" in r.stdout


def test_archcheck_refuses_a_room_out_of_order(tmp_path):
    """The failure path's rooms import only the rooms before them: detect -> decide -> repair -> job."""
    for rel, src in {"runtime/__init__.py": "", "phoenix_launch/__init__.py": "",
                     "phoenix_launch/detect/__init__.py": "", "phoenix_launch/decide/__init__.py": "",
                     "phoenix_launch/repair/__init__.py": "", "phoenix_launch/job/__init__.py": "",
                     "phoenix_launch/detect/nodes.py": "from phoenix_launch.decide.incidents import FleetView\n",
                     "phoenix_launch/decide/incidents.py": "from phoenix_launch.detect import health\n",
                     "phoenix_launch/detect/health.py": "",
                     "phoenix_launch/repair/generations.py": "def f():\n    from phoenix_launch.job import step\n",
                     "phoenix_launch/job/step.py": "from phoenix_launch.repair import generations\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    problems = sorted(line.split(";")[0] for line in r.stdout.splitlines() if line.startswith("room order"))
    assert r.returncode == 1 and problems == [
        "room order: phoenix_launch.detect.nodes (detect) imports phoenix_launch.decide.incidents (decide)",
        "room order: phoenix_launch.repair.generations (repair) imports phoenix_launch.job.step (job)"], r.stdout


def _calls_with_a_dict(root: Path):
    """``x.report({...})``, ``x.post(dict(...))``, ``q.put({...})``: a message built by hand instead of typed."""
    import ast

    for f in sorted([*(root / "runtime").rglob("*.py"), *(root / "phoenix_launch").rglob("*.py")]):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("report", "post", "put")
                    and node.args and (isinstance(node.args[0], ast.Dict) or (isinstance(node.args[0], ast.Call)
                                       and getattr(node.args[0].func, "id", None) == "dict"))):
                yield f"{f.relative_to(root)}:{node.lineno}"


def test_every_message_is_a_protocol_dataclass(tmp_path):
    """Typed both ways: no report, post or queue put of a hand-built dict anywhere in the runtime or the
    launcher (``Queue.put`` refuses one at run time too; the supervisor's handlers: ``test_pure``)."""
    assert list(_calls_with_a_dict(ROOT)) == []
    (tmp_path / "runtime").mkdir()
    (tmp_path / "phoenix_launch").mkdir()
    (tmp_path / "runtime" / "x.py").write_text('ctx.report({"type": "rank_error", "fatal": False})\nq.put(dict(type="stop"))\n')
    assert list(_calls_with_a_dict(tmp_path)) == ["runtime/x.py:1", "runtime/x.py:2"]


def _reached(path: Path, cls: str, names: tuple[str, ...]) -> dict[str, set[str]]:
    """name -> the attributes ``self.<name>.X`` (or a local bound to ``self.<name>``) the methods of ``cls`` reach."""
    import ast

    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: dict[str, set[str]] = {n: set() for n in names}
    for fn in (n for n in node.body if isinstance(n, ast.FunctionDef)):
        alias = {n: n for n in names}  # locals bound to self.<name> (``ops, rs = self.ops, self.rs``)
        for a in ast.walk(fn):
            if isinstance(a, ast.Assign):
                targets = a.targets[0].elts if isinstance(a.targets[0], ast.Tuple) else [a.targets[0]]
                values = a.value.elts if isinstance(a.value, ast.Tuple) else [a.value]
                for t, v in zip(targets, values):
                    if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) \
                            and v.value.id == "self" and v.attr in names:
                        alias[t.id] = v.attr
        for a in ast.walk(fn):
            if not isinstance(a, ast.Attribute):
                continue
            base = a.value
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self" and base.attr in names:
                out[base.attr].add(a.attr)
            elif isinstance(base, ast.Name) and base.id in alias:
                out[alias[base.id]].add(a.attr)
    return out


def test_the_step_guard_and_the_recovery_reach_only_the_rank_state_and_the_training_ops():
    """The step guard and the recovery session get the rank's state (``RankState``) and the training's operations
    (``TrainingOps``) as parameters; every attribute they reach on either is declared there: nothing else of the
    training object is reachable from them."""
    import dataclasses
    import typing

    from phoenix_runtime.rank_state import RankState, TrainingOps

    fields = {f.name for f in dataclasses.fields(RankState)} | {n for n in vars(RankState) if not n.startswith("__")}
    ops = set(typing.get_type_hints(TrainingOps)) | {n for n in vars(TrainingOps) if not n.startswith("_")}
    for path, cls in ((ROOT / "runtime" / "step_guard.py", "StepGuard"),
                      (ROOT / "runtime" / "recover" / "recovery_session.py", "RecoverySession")):
        reached = _reached(path, cls, ("rs", "ops"))
        assert reached["rs"] and reached["ops"], (cls, reached)
        assert reached["rs"] <= fields, (cls, reached["rs"] - fields)
        assert reached["ops"] <= ops, (cls, reached["ops"] - ops)
        assert not _reached(path, cls, ("t",))["t"], cls  # no training object held as ``self.t``
    path = ROOT / "runtime" / "recover" / "strategies.py"  # a layout's strategy calls the same operations
    import ast

    for cls in (n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
        assert _reached(path, cls, ("ops",))["ops"] <= ops, (cls, _reached(path, cls, ("ops",))["ops"] - ops)


def _unnamed_in_design(doc: str, modules: list[tuple[str, str]]) -> list[str]:
    """The modules (package, path in it) that ``doc`` (docs/design.md) does not name: by their path in the package
    (``protection/pairs.py``), as `` `name` `` or `` `name.py` ``, or in the rooms' inventory (the paragraph "The
    folders are the rooms."); a name that two modules share counts only with its folder (``job/resize``), or with
    its package (``phoenix_runtime.sdc``, ``phoenix_launch/plane/control.py``) where that is shared too."""
    import re
    from collections import Counter

    inventory = doc[doc.index("The folders are the rooms."):]
    inventory = inventory[:inventory.index("\n\n")]
    shared = Counter(Path(rel).stem for _, rel in modules)
    shared_folder = Counter(rel[:-3] for _, rel in modules)
    out = []
    for pkg, rel in modules:
        name, folder = Path(rel).stem, Path(rel).parent.as_posix()
        if shared[name] > 1:  # with its folder, or its package too where the folder is shared (``plane/control``)
            dotted = ("phoenix_runtime" if pkg == "runtime" else pkg) + "." + rel[:-3].replace("/", ".")
            named = dotted in doc or f"{pkg}/{rel}" in doc or (
                folder != "." and f"{folder}/{name}" in doc and shared_folder[f"{folder}/{name}"] == 1)
        else:
            named = rel in doc or f"`{name}`" in doc or f"`{name}.py`" in doc or bool(re.search(rf"\b{name}\b", inventory))
        if not named:
            out.append(f"{pkg}/{rel}")
    return out


def test_the_design_page_names_every_module():
    """docs/design.md is the map: every module of ``runtime/`` and ``phoenix_launch/`` is on it (issue 47)."""
    modules = [(pkg, p.relative_to(ROOT / pkg).as_posix()) for pkg in ("runtime", "phoenix_launch")
               for p in sorted((ROOT / pkg).rglob("*.py")) if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) > 100
    assert _unnamed_in_design((ROOT / "docs" / "design.md").read_text(), modules) == []
    # the rule itself: a module missing from the page is found, a shared name needs its folder
    doc = "The folders are the rooms. `a/` (one, two)\n\nand `job/x` here"
    got = _unnamed_in_design(doc, [("p", "a/one.py"), ("p", "a/three.py"), ("p", "job/x.py"), ("p", "recover/x.py")])
    assert got == ["p/a/three.py", "p/recover/x.py"]
