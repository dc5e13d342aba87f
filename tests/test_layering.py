"""The tree's dependencies point one way, read from the source with ast (every import, lazy ones included). Each
top-level folder is one floor:

    apps         evals/, dashboards/, benchmarks/, notebooks/, cli/ (the program: `python -m workbench`), examples/
                 (designs of your own, as a user writes them)
    experiments  experiments/ (bench, ladders, traces, the simulator, the llama.cpp peer) and training/
    session      runtime/ (Session, routing capture, speculative decoding, the verbs that run a session)
    engines      engines/ (numpy, packed, MLX, llama.cpp with GGUF export)
    core         workbench/ (errors, spec, store, io, cache, streamer, predict, routing, presets, telemetry, ...)

A module may import its own floor and the floors below; no module imports itself back through others.

One exception, by necessity: `workbench/__main__.py`. `python -m workbench` (the README, the Makefile, the docs,
the tests) runs the core package's __main__, and the program lives on the top floor (cli/). That file is a
program, never imported by a module, and does nothing but hand over to cli.main: it counts as an app.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (floor, its folders), lowest first
LAYERS = [
    ("core", ["workbench"]),
    ("engines", ["engines"]),
    ("session", ["runtime"]),
    ("experiments", ["experiments", "training"]),
    ("apps", ["evals", "dashboards", "benchmarks", "notebooks", "cli", "examples"]),
]
PACKAGES = [folder for _, folders in LAYERS for folder in folders]
PROGRAM = "workbench.__main__"      # the one exception (the docstring): `python -m workbench` hands over to cli


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = f.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer_of(module: str) -> int:
    """The floor of a module: its top-level folder's."""
    if module == PROGRAM:
        return len(LAYERS) - 1
    folder = module.partition(".")[0]
    rank = next((i for i, (_, folders) in enumerate(LAYERS) if folder in folders), None)
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
    mods = {"workbench.a": tmp_path / "a.py", "workbench.b": tmp_path / "b.py", "runtime.session": tmp_path / "s.py"}
    mods["workbench.a"].write_text("def f():\n    from workbench import b\n")
    mods["workbench.b"].write_text("import workbench.a\nfrom runtime.session import Session\n")
    mods["runtime.session"].write_text("")
    graph = imports(mods)
    assert graph == {"workbench.a": {"workbench.b"}, "workbench.b": {"workbench.a", "runtime.session"},
                     "runtime.session": set()}
    assert layer_of("runtime.session") > layer_of("workbench.b")


def test_every_folder_of_python_is_on_a_floor():
    """A new top-level folder of modules has to say which floor it is on (tests/ and the venvs aside)."""
    folders = {f.relative_to(REPO).parts[0] for f in REPO.glob("*/**/*.py")}
    unplaced = sorted(folders - set(PACKAGES) - {"tests"} - {f for f in folders if f.startswith(".")})
    assert not unplaced, f"folders on no floor: {unplaced}"


def test_the_one_exception_only_hands_over_to_the_program():
    graph = imports(modules())
    assert graph[PROGRAM] == {"cli"}
    assert not [m for m, deps in graph.items() if PROGRAM in deps]
    assert layer_of("workbench.commands") == 0 and layer_of("cli") == len(LAYERS) - 1
