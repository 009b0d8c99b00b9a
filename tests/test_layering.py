"""The code's layering: imports run one way, down the floors docs/architecture.md names ("Layering"), with no
cycles between modules of the library, the kernels and the converter, and no module reaches into another's
private names. Read from the source with ``ast`` (imports inside functions included), so a violation fails
here before it confuses a reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hetero_jax", "pallas_kernels", "convert")
CHECKED = PACKAGES + ("benchmarks",)

# Bottom to top: a module may import its own floor and the floors below it, never one above. The names are
# packages or modules; a module belongs to the longest name it starts with ("hetero_jax" alone is the package's
# __init__). docs/architecture.md ("Layering") writes the same order.
FLOORS = (
    ("hetero_jax.errors", "hetero_jax.dims", "hetero_jax.water_filling"),
    ("pallas_kernels",),
    ("hetero_jax.model",),
    ("hetero_jax.io",),
    ("hetero_jax.runtime",),
    ("hetero_jax.profile",),
    ("hetero_jax.policies",),
    ("hetero_jax.serve", "hetero_jax.cli", "hetero_jax.launch", "hetero_jax", "convert"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[0] == "benchmarks":  # scripts import each other by bare name (benchmarks/ is on sys.path)
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(roots) -> dict[str, ast.Module]:
    out = {}
    for root in roots:
        for p in sorted((REPO / root).rglob("*.py")):
            out[_module_name(p)] = ast.parse(p.read_text(), str(p))
    return out


def _imports(tree: ast.Module):
    """(module, imported name or None) for every import statement, lazy ones inside functions included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                yield node.module, a.name


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def import_graph(sources) -> dict[str, set[str]]:
    graph = {m: set() for m in sources}
    for m, tree in sources.items():
        for mod, name in _imports(tree):
            target = _resolve(f"{mod}.{name}" if name else mod, sources)
            if target and target != m and not m.startswith(target + "."):  # a package's own __init__ is no edge
                graph[m].add(target)
    return graph


def floor_of(module: str, floors=FLOORS) -> int | None:
    """Index of the floor ``module`` belongs to (0 = bottom), None when no floor names it."""
    best, found = -1, None
    for i, names in enumerate(floors):
        for n in names:
            inside = module == n or (module.startswith(n + ".") and n != "hetero_jax")
            if inside and len(n) > best:
                best, found = len(n), i
    return found


def upward_imports(sources, floors=FLOORS) -> list[str]:
    """Every import (lazy ones inside functions included) of a module on a higher floor than the importer's.
    ``import hetero_jax`` counts as importing the package's __init__, the top floor."""
    bad = []
    for m, tree in sources.items():
        own = floor_of(m, floors)
        for mod, name in _imports(tree):
            target = _resolve(f"{mod}.{name}" if name else mod, sources)
            if target is None or target == m:
                continue
            there = floor_of(target, floors)
            if own is not None and there is not None and there > own:
                bad.append(f"{m} (floor {own}) imports {target} (floor {there})")
    return list(dict.fromkeys(bad))  # one line per pair, in the order found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_on_a_hand_made_graph():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_has_a_floor():
    lost = [m for m in _sources(PACKAGES) if floor_of(m) is None]
    assert not lost, f"modules on no floor (add their package to FLOORS and to docs/architecture.md): {lost}"


def test_floor_check_on_a_hand_made_graph():
    """A lazy import from the runtime up to policies, and one from the model up to io, are found; imports down
    the floors and within one are not."""
    src = {
        "hetero_jax.runtime.engine": ast.parse("import numpy\nfrom hetero_jax.model.cache import kv_bytes\n"
                                               "def bind(p):\n    from hetero_jax.policies import FullKV\n"),
        "hetero_jax.model.cache": ast.parse("import hetero_jax.io.files\nfrom hetero_jax.model import spec\n"),
        "hetero_jax.model.spec": ast.parse("from hetero_jax.errors import ConfigError\n"),
        "hetero_jax.io.files": ast.parse("from hetero_jax.errors import OutputError\n"),
        "hetero_jax.errors": ast.parse(""),
        "hetero_jax.policies": ast.parse("from hetero_jax.runtime.engine import bind\n"),
        "hetero_jax.profile.cli": ast.parse("def run():\n    import hetero_jax\n"),
        "hetero_jax": ast.parse("from hetero_jax.policies import FullKV\n"),
    }
    assert upward_imports(src) == [
        "hetero_jax.runtime.engine (floor 4) imports hetero_jax.policies (floor 6)",
        "hetero_jax.model.cache (floor 2) imports hetero_jax.io.files (floor 3)",
        "hetero_jax.profile.cli (floor 5) imports hetero_jax (floor 7)",
    ]
    assert floor_of("hetero_jax.cli") == floor_of("hetero_jax") == floor_of("convert.cli") == len(FLOORS) - 1
    assert floor_of("hetero_jax.model") == 2 and floor_of("hetero_jax.modelx") is None


def test_imports_run_down_the_floors():
    bad = upward_imports(_sources(PACKAGES))
    assert not bad, ("imports from a lower floor to a higher one (move the shared part down, or let the higher "
                     "floor pass it in):\n" + "\n".join(bad))


def test_architecture_names_the_same_floors():
    short = [", ".join("hetero_jax/__init__" if n == "hetero_jax" else n.replace("hetero_jax.", "")
                       for n in names) for names in FLOORS]
    line = "Floors, bottom to top: " + " -> ".join(short) + "."
    assert line in " ".join((REPO / "docs" / "architecture.md").read_text().split()), line


def test_no_import_cycles():
    found = cycles(import_graph(_sources(PACKAGES)))
    assert not found, f"import cycles (move the shared part into a module both can import): {found}"


def test_no_module_imports_another_modules_private_names():
    sources = _sources(CHECKED)
    bad = []
    for m, tree in sources.items():
        aliases = {}  # local name -> module it stands for
        for mod, name in _imports(tree):
            target = f"{mod}.{name}" if name else mod
            if name and _private(name) and _resolve(mod, sources) != m:
                bad.append(f"{m}: from {mod} import {name}")
            if _resolve(target, sources) == target:
                aliases[target.rpartition(".")[2] if name else target.split(".")[0]] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in sources:
                        aliases[a.asname or a.name] = full
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != m):
                bad.append(f"{m}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not bad, "private names used across modules (make them public or move the code):\n" + "\n".join(bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_library_never_imports_benchmarks_or_tests(package):
    # the names a benchmark or test module is imported by (bare, as benchmarks/ and tests/ sit on sys.path)
    top = {p.stem for d in ("benchmarks", "tests") for p in (REPO / d).glob("*.py")}
    top |= {p.parent.name for p in (REPO / "benchmarks").glob("*/__init__.py")} | {"benchmarks", "tests"}
    assert {"common", "haystack", "harness", "bench_needle", "tiny_model"} <= top
    for m, tree in _sources([package]).items():
        for mod, _ in _imports(tree):
            assert mod.split(".")[0] not in top, f"{m} imports {mod}"


def test_only_the_cli_imports_the_server():
    """hetero_jax/serve is the top floor beside the CLI: it imports the runtime, io and policies, and nothing of
    the library imports it back (the library must not need the web stack)."""
    bad = []
    for m, tree in _sources(PACKAGES).items():
        if m == "hetero_jax.cli" or m == "hetero_jax.serve" or m.startswith("hetero_jax.serve."):
            continue
        bad += [f"{m} imports {mod}" for mod, _ in _imports(tree)
                if mod == "hetero_jax.serve" or mod.startswith("hetero_jax.serve.")]
    assert not bad, bad
    assert "hetero_jax.serve.app" in _sources(PACKAGES)  # the check sees the server's modules


def test_size_limits():
    """docs/architecture.md's limits, so that the house keeps the shape it was given (issue 39): no file of the
    HeteroCache wing over 300 lines and no class there over 150; no benchmark script or harness module over 450."""
    too_long = []
    for p in sorted((REPO / "hetero_jax/policies/heterocache").glob("*.py")):
        text = p.read_text()
        if len(text.splitlines()) > 300:
            too_long.append(f"{p.relative_to(REPO)}: {len(text.splitlines())} lines > 300")
        for c in ast.walk(ast.parse(text)):
            if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > 150:
                too_long.append(f"{p.relative_to(REPO)}: class {c.name} {c.end_lineno - c.lineno + 1} lines > 150")
    for p in sorted((REPO / "benchmarks").rglob("*.py")):
        n = len(p.read_text().splitlines())
        if n > 450:
            too_long.append(f"{p.relative_to(REPO)}: {n} lines > 450")
    assert not too_long, "split by concern:\n" + "\n".join(too_long)


def test_every_error_class_docs_errors_md_names_is_an_attribute_of_hetero_jax():
    """docs/errors.md told users to catch BudgetError, PolicyError, ProfileError, MeshError, ... none of which
    ``hetero_jax`` had (review 94); the policies' and profiles' are read on first use, so ``import hetero_jax``
    still loads neither floor."""
    import re
    import subprocess
    import sys

    import hetero_jax

    text = (REPO / "docs" / "errors.md").read_text()
    others = {"JaxRuntimeError", "MemoryError", "OSError", "TypeError"}  # jax's and Python's, named as such
    named = set(re.findall(r"`(?:hetero_jax\.)?([A-Z][A-Za-z]*Error)`", text)) - others
    assert {"BudgetError", "PolicyError", "ProfileError", "MeshError", "PromptError"} <= named
    for name in sorted(named):
        cls = getattr(hetero_jax, name)
        assert issubclass(cls, hetero_jax.HeteroJaxError) and name in hetero_jax.__all__, name
    light = subprocess.run([sys.executable, "-c", "import sys, hetero_jax; print(any(m.startswith("
                            "('hetero_jax.policies', 'hetero_jax.profile')) for m in sys.modules))"],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
    assert light.stdout.strip() == "False", light.stderr[-2000:]
