"""The tree's dependencies point one way, read from the source with ast (every import, lazy ones included):

    apps (dashboards, notebooks, evals, benchmarks, the CLI)
      -> experiments (bench, ladders, traces, the llama.cpp peer) and training
      -> session (session, routing capture, speculative decoding, the runtime's verbs)
      -> engines (numpy, MLX, llama.cpp with GGUF export)
      -> core (errors, spec, store, io, cache, streamer, predict, routing, presets, telemetry, runs, ...)

A module may import its own layer and the layers below; no module imports itself back through others.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("workbench", "engines", "evals", "experiments", "training", "dashboards", "benchmarks", "notebooks")

# (layer, module prefixes), lowest first; the longest matching prefix decides a module's layer
LAYERS = [
    ("core", ["workbench"]),
    ("engines", ["engines"]),
    ("session", ["workbench.session", "workbench.capture", "workbench.speculative", "workbench.verbs"]),
    ("experiments", ["experiments", "training"]),
    ("apps", ["evals", "dashboards", "notebooks", "benchmarks", "workbench.cli", "workbench.__main__"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = f.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module}: in no layer"
    return rank


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project's modules it imports}; `from a import b` names a.b when that is a module."""
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_every_import_points_down_the_layers():
    graph = imports(modules())
    bad = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
           for m, deps in graph.items() for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = imports(modules())
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The two tests above can fail: a package edge that is only a name (`from a import b`) still counts."""
    mods = {"workbench.a": tmp_path / "a.py", "workbench.b": tmp_path / "b.py", "workbench.session": tmp_path / "s.py"}
    mods["workbench.a"].write_text("def f():\n    from workbench import b\n")
    mods["workbench.b"].write_text("import workbench.a\nfrom workbench.session import Session\n")
    mods["workbench.session"].write_text("")
    graph = imports(mods)
    assert graph == {"workbench.a": {"workbench.b"}, "workbench.b": {"workbench.a", "workbench.session"},
                     "workbench.session": set()}
    assert layer_of("workbench.session") > layer_of("workbench.b")
