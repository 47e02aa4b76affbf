"""The package's layout holds: imports point down the floors of DESIGN.md, nothing else is
installed beside `jaxgen`, and the host-side scheduler needs no JAX, Flax or tokenizer."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "jaxgen")
# Top floor first; a module may import its own package or any package after it in this list.
FLOORS = [
    "cli",
    "bench",
    "entrypoints",
    "engine",
    "errors",  # jaxgen/errors.py: the typed input errors, re-exporting the model's
    "sharding",
    "model",
    "quant",
    "cache",
    "pallas_kernels",
    "_lazy",  # jaxgen/_lazy.py: the packages' lazy exports
    "_logging",  # jaxgen/_logging.py: the jaxgen logger's handler
]
TOP_LEVEL = {  # `from jaxgen import NAME` resolves lazily to these packages
    "LLM": "entrypoints",
    "SamplingParams": "engine",
    "CompletionOutput": "engine",
    "Logprob": "engine",
    "RequestMetrics": "engine",
    "RequestOutput": "engine",
}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "jaxgen" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in FLOORS else None


def imports(path: str):
    """(line, target package) for every import of jaxgen in a file, lazy ones included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxgen":
                for alias in node.names:
                    yield node.lineno, TOP_LEVEL.get(alias.name, package_of(f"jaxgen.{alias.name}"))
            else:
                yield node.lineno, package_of(node.module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, package_of(alias.name)


def source_files():
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, PACKAGE)
                head = relative.split(os.sep)[0].removesuffix(".py")
                yield path, head


def test_imports_point_down_the_floors():
    upward, checked = [], 0
    for path, package in source_files():
        if package == "__init__":
            continue  # jaxgen/__init__.py: lazy names only
        assert package in FLOORS, f"{path}: a package missing from DESIGN.md's floors"
        for line, target in imports(path):
            if target is None or target == package:
                continue
            checked += 1
            if FLOORS.index(target) <= FLOORS.index(package):
                upward.append(f"{os.path.relpath(path, ROOT)}:{line} {package} -> {target}")
    assert checked > 50  # the walk saw the package's imports
    assert not upward, "imports that run up the floors:\n" + "\n".join(upward)


def test_the_package_never_imports_the_studies():
    """`benchmarks/` (top level, not installed) imports jaxgen, never the other way."""
    found = []
    for path, _ in source_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, f"jaxgen imports the studies: {found}"


def test_only_jaxgen_is_packaged():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["jaxgen", "jaxgen.*"]
    from setuptools import find_packages

    found = find_packages(ROOT, include=include)
    assert found and all(p == "jaxgen" or p.startswith("jaxgen.") for p in found)
    assert {"jaxgen.engine.sched", "jaxgen.entrypoints", "jaxgen.cli"} <= set(found)


def test_host_scheduler_needs_no_jax_flax_or_tokenizer():
    code = (
        "import sys\n"
        "import jaxgen.engine.sched.scheduler, jaxgen.cache.block_manager\n"
        "print(sorted(m for m in ('jax', 'flax', 'tokenizers', 'jaxgen.pallas_kernels')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of its own package (`jaxgen.<package>`) it imports, lazy imports
    included; `from package import submodule` counts as the submodule, and a module's own
    parent packages (always imported first) are left out."""
    modules = {}
    for path, _ in source_files():
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets.update([s for s in subs if s in modules] or [node.module])
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {
            t
            for t in targets
            if t in modules
            and t != name
            and not name.startswith(t + ".")
            and t.split(".")[:2] == name.split(".")[:2]
        }
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

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
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circles_inside_a_package():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100  # the walk saw the package's imports
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    circles = import_circles(graph)
    assert circles == [], (
        f"modules of one package importing each other: {circles}; "
        "move what both need into a module of its own"
    )
