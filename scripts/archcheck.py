"""Architecture checks: no production file over 600 lines, no function over 80, no import cycle, the
runtime never imports the launcher, the launcher imports only the runtime's torch-free leaves, its core never
imports the add-ons (``simulate``, ``report``; only the CLI's subcommands, inside a function), and the rooms of the
failure path keep their order (``ROOMS``: a room imports only the rooms before it -- detect never decide, decide
never repair, repair never the job's step).

    python3 scripts/archcheck.py [REPO_ROOT]       # exit 1 and one line per problem when any is found
"""
import ast
import collections
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
pkgs = {"phoenix_launch": root / "phoenix_launch", "phoenix_runtime": root / "runtime"}
mods = {}
for pkg, d in pkgs.items():
    for f in d.rglob("*.py"):
        rel = f.relative_to(d).with_suffix("")
        name = ".".join([pkg, *rel.parts]).removesuffix(".__init__")
        mods[name] = f
ADDONS = ("phoenix_launch.simulate", "phoenix_launch.report")
ROOMS = ("detect", "decide", "repair", "job")  # the failure path, in order: detect -> decide -> repair -> the step
def room(m):
    parts = m.split(".")
    return parts[1] if parts[0] == "phoenix_launch" and len(parts) > 2 and parts[1] in ROOMS else None
def addon(m): return any(m == a or m.startswith(a + ".") for a in ADDONS)
bad = []
graph = collections.defaultdict(set)
for name, f in mods.items():
    src = f.read_text(); tree = ast.parse(src)
    top = {id(node) for node in tree.body}
    n = len(src.splitlines())
    if n > 600: bad.append(f"file {f} {n} lines")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ln = node.end_lineno - node.lineno + 1
            if ln > 80: bad.append(f"function {f}:{node.lineno} {node.name} {ln} lines")
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
            targets = subs if len(subs) == len(node.names) else [node.module] + subs
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t in mods and t != name:
                graph[name].add(t)
            if addon(t) and name.startswith("phoenix_launch") and not addon(name) and (name != "phoenix_launch.cli" or id(node) in top):
                bad.append(f"core imports add-on {t} from {name}:{node.lineno}")
for name, deps in sorted(graph.items()):
    for d in sorted(deps):
        a, b = room(name), room(d)
        if a and b and ROOMS.index(b) > ROOMS.index(a):
            bad.append(f"room order: {name} ({a}) imports {d} ({b}); {' -> '.join(ROOMS)}")
    if name.startswith("phoenix_runtime") and any(d.startswith("phoenix_launch") for d in deps):
        bad.append(f"runtime imports launcher: {name}")
    if name.startswith("phoenix_launch"):
        for d in deps:
            if d.startswith("phoenix_runtime") and d not in ("phoenix_runtime.plane.protocol", "phoenix_runtime.plane.settings", "phoenix_runtime.plane.auth", "phoenix_runtime",
                                                         "phoenix_runtime.errors", "phoenix_runtime.logs",
                                                         "phoenix_runtime.plane.failover",  # the store client both sides hold (lazily)
                                                         "phoenix_runtime.plane.watch",  # the notify watcher both sides run
                                                         "phoenix_runtime.plane.relay"):  # the node's relay, both sides
                bad.append(f"launcher imports runtime module {d} from {name}")
# cycles (module level and function level imports alike)
sys.setrecursionlimit(10000)
state = {}
def dfs(u, stack):
    state[u] = 1; stack.append(u)
    for v in graph.get(u, ()):
        if state.get(v) == 1:
            bad.append("cycle: " + " -> ".join(stack[stack.index(v):] + [v]))
        elif v not in state:
            dfs(v, stack)
    stack.pop(); state[u] = 2
for m in mods:
    if m not in state: dfs(m, [])
print(f"{len(mods)} modules; {sum(len(v) for v in graph.values())} internal imports")
print("\n".join(bad) if bad else "OK: no file > 600 lines, no function > 80 lines, no cycle, no add-on in the core, rooms in order, no upward import")
sys.exit(1 if bad else 0)
