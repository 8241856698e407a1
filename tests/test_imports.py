"""Imports flow one way (CLI -> generate -> ddtree -> decoding -> model -> kernels): no circles, and none
hidden behind a function-level import. Read from the source (AST), so nothing is imported here."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kdtree_jax"
# function-level imports of the engine that are not hiding a circle: the CLI's start-up time (--help
# must not import JAX), and generate's Mosaic-kernel note (module, function) that is being replaced
LAZY_ALLOWED = {("generate", "_note_faster_moe_kernel")}


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def _engine_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The kdtree_jax modules an import statement names ("kdtree_jax.x" or "from kdtree_jax import x")."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module == "kdtree_jax":
        names = [f"kdtree_jax.{alias.name}" for alias in node.names]
    else:
        names = [node.module or ""]
    return [name.split(".")[1] for name in names if name.startswith("kdtree_jax.")]


def _module_level_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, tree in modules.items():
        deps = set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(m for m in _engine_modules(node) if m in modules)
        graph[name] = deps
    return graph


def test_module_level_imports_have_no_circle():
    graph = _module_level_graph()
    graph.pop("__init__")  # the package's public face imports everything; nothing imports it by name
    state: dict[str, str] = {}

    def visit(name, path):  # depth-first; meeting a module still open closes a circle
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                raise AssertionError(f"import circle: {' -> '.join([*path, name, dep])}")
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_decode_path_flows_one_way():
    graph = _module_level_graph()
    assert "ddtree" in graph["generate"] and "decoding" in graph["generate"]
    assert "decoding" in graph["ddtree"] and "generate" not in graph["ddtree"]
    assert not {"generate", "ddtree"} & graph["decoding"]


def test_no_function_level_engine_imports_outside_the_cli():
    found = []
    for name, tree in _modules().items():
        if name == "cli":
            continue
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if (isinstance(node, (ast.Import, ast.ImportFrom)) and _engine_modules(node)
                        and (name, function.name) not in LAZY_ALLOWED):
                    found.append(f"{name}.py:{node.lineno} in {function.name}: {ast.unparse(node)}")
    assert not found, found


def test_cli_imports_no_private_engine_names():
    private = [f"cli.py:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(_modules()["cli"])
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kdtree_jax")
               and any(alias.name.startswith("_") for alias in node.names)]
    assert not private, private
