"""fedfields' subpackages import one way (no cycle) and never the Flower App around them, and
the modules of its Flower layer (fedfields/flower) import one way among themselves.

Modules are parsed, not imported, so every import counts: relative ones, those inside
functions and those under `if TYPE_CHECKING`. Nodes come from the filesystem: each
subpackage of fedfields is one node, each top-level module its own; inside fedfields/flower
each module is a node, its `__init__` the package's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedfields"
FLOWER_LAYER = PACKAGE / "flower"
APP_PACKAGES = ("strategies", "clients", "simulations")  # the repo's Flower App, not in the wheel

Graph = dict[str, dict[str, list[str]]]  # node -> imported node -> ["path:line", ...]


def module_name(path: Path) -> str:
    """Dotted name of a module file under the repository root; `__init__` names its package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, package: str) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import in `source`, a module of `package`.

    `from m import n` yields both m and m.n, since n may be a submodule.
    """
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield module, node.lineno
            for alias in node.names:
                if alias.name != "*":
                    yield f"{module}.{alias.name}", node.lineno


def package_node(module: str) -> str:
    """The node of a fedfields module: fedfields.<sub> for a subpackage or top-level module."""
    parts = module.split(".")
    if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return f"fedfields.{parts[1]}"
    return "fedfields"


def module_imports() -> Iterator[tuple[Path, str, int]]:
    """(file, imported module, line) for every import of every module under fedfields/."""
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, line in imports(path.read_text(), package):
            yield path, module, line


def package_graph() -> Graph:
    """Arrows between fedfields' nodes, each with the file and line of every import behind it."""
    graph: Graph = {}
    for path, module, line in module_imports():
        source, target = package_node(module_name(path)), package_node(module)
        if module.split(".")[0] != "fedfields" or source == target:
            continue
        add_arrow(graph, source, target, f"{path.relative_to(ROOT)}:{line}")
    return graph


def add_arrow(graph: Graph, source: str, target: str, where: str) -> None:
    """Record the import at `where` ("path:line") behind the arrow source -> target."""
    places = graph.setdefault(source, {}).setdefault(target, [])
    if where not in places:
        places.append(where)


def flower_module_graph() -> Graph:
    """Arrows between the modules of fedfields/flower, each with the file and line of every
    import behind it; `from fedfields.flower.m import name` is an arrow to m."""
    modules = {module_name(path) for path in FLOWER_LAYER.glob("*.py")}
    graph: Graph = {}
    for path, module, line in module_imports():
        if path.parent != FLOWER_LAYER:
            continue
        source = module_name(path)
        target = module if module in modules else module.rpartition(".")[0]
        if target not in modules or target == source:
            continue
        add_arrow(graph, source, target, f"{path.relative_to(ROOT)}:{line}")
    return graph


def repository_module_graph() -> Graph:
    """Arrows between every module of the library and the App (fedfields, strategies,
    clients, simulations), each with the file and line of every import behind it:
    `from m import n` is an arrow to the module m.n where n is a submodule, else to m (a
    package's arrow goes to its `__init__`)."""
    files = [path for root in ("fedfields", *APP_PACKAGES) for path in (ROOT / root).rglob("*.py")]
    modules = {module_name(path) for path in files}
    graph: Graph = {}
    for path in sorted(files):
        source = module_name(path)
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = next(imports(ast.unparse(node), package))[0]
                targets = [
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                    for alias in node.names
                ]
            for target in targets:
                if target in modules and target != source:
                    add_arrow(graph, source, target, f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """One cycle of `graph` as [a, b, ..., a], or [] when there is none (depth-first, sorted)."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str]:
        on_path.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor in on_path:
                return [*on_path[on_path.index(successor) :], successor]
            if successor not in done:
                cycle = visit(successor)
                if cycle:
                    return cycle
        on_path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def describe_cycle(cycle: list[str], graph: Graph) -> str:
    """The cycle on one line, then each arrow with the imports that make it."""
    arrows = [f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in pairwise(cycle)]
    return "\n".join([" -> ".join(cycle), *arrows])


def test_subpackages_import_one_way() -> None:
    graph = package_graph()
    assert len(graph) > 1, f"found almost no imports between fedfields' subpackages: {graph}"
    cycle = find_cycle(graph)
    assert not cycle, "package cycle in fedfields:\n" + describe_cycle(cycle, graph)


def test_the_flower_layers_modules_import_one_way() -> None:
    graph = flower_module_graph()
    assert len(graph) > 5, f"found almost no imports between fedfields/flower's modules: {graph}"
    cycle = find_cycle(graph)
    assert not cycle, "module cycle in fedfields/flower:\n" + describe_cycle(cycle, graph)


def test_no_module_of_the_library_or_the_app_imports_round_a_circle() -> None:
    """Issue 56: no import circle anywhere in the tree, between modules of one package too
    (a circle makes the import order matter and hides which module is the lower one)."""
    graph = repository_module_graph()
    assert "fedfields.train.federated" in graph  # the graph is read, not empty
    cycle = find_cycle(graph)
    assert not cycle, describe_cycle(cycle, graph)


def test_library_never_imports_the_flower_app() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path, module, line in module_imports()
        if module.split(".")[0] in APP_PACKAGES
    ]
    assert not offending, "fedfields imports the Flower App:\n" + "\n".join(offending)


def test_the_server_side_imports_nothing_of_the_clients() -> None:
    """The ServerApp's jobs, observers and launchers share names with the clients only through
    the library (the protocol's records, the split protocol's files); `simulations.run`, which
    builds the simulation's ClientApp, is the one simulations module that imports clients/."""
    offending = []
    for path in sorted((ROOT / "simulations").rglob("*.py")):
        name = module_name(path)
        if name == "simulations.run":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        offending += [
            f"{path.relative_to(ROOT)}:{line} imports {module}"
            for module, line in imports(path.read_text(), package)
            if module.split(".")[0] == "clients"
        ]
    assert not offending, "the server side imports clients/:\n" + "\n".join(offending)


def test_find_cycle_spells_out_a_cycle_with_its_imports() -> None:
    graph: Graph = {
        "fedfields.render": {"fedfields.data": ["fedfields/render/rays.py:10"]},
        "fedfields.data": {
            "fedfields.geometry": ["fedfields/data/scene.py:20"],
            "fedfields.render": ["fedfields/data/crowd.py:36"],
        },
        "fedfields.train": {"fedfields.render": ["fedfields/train/centralised.py:23"]},
    }
    cycle = find_cycle(graph)
    assert cycle == ["fedfields.data", "fedfields.render", "fedfields.data"]
    message = describe_cycle(cycle, graph)
    assert message.splitlines()[0] == "fedfields.data -> fedfields.render -> fedfields.data"
    assert "fedfields/data/crowd.py:36" in message and "fedfields/render/rays.py:10" in message
    del graph["fedfields.render"]
    assert find_cycle(graph) == []


def test_imports_resolves_relative_and_function_level_imports() -> None:
    source = "def load():\n    from ..render import rays\n    from . import scene\n"
    found = set(imports(source, "fedfields.data"))
    assert ("fedfields.render.rays", 2) in found
    assert ("fedfields.data.scene", 3) in found
