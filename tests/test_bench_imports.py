"""Every benchmarks/*.py imports only names that exist: parsed with ast (lazy imports inside functions too),
so a removed engine name fails on CPU instead of on the GPU box."""

import ast
import importlib
import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
OURS = ("pallas_kernels", "kdtree_jax", "reference", "benchmarks")


def _imports(path: pathlib.Path) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) for every import of our packages anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in OURS:
                found += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] in OURS]
    return found


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _in_scope(scope):
    """The nodes of one scope, not those of the functions / classes nested in it (yielded themselves)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _import_aliases(node) -> dict[str, str]:
    """{local name: module} for an import that binds one of our modules."""
    out = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.split(".")[0] in OURS:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in OURS:
        for a in node.names:
            if _is_module(f"{node.module}.{a.name}"):
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _module_attributes(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(module, attribute, line) for every `alias.attr` where alias names one of our modules in its scope
    (`import kdtree_jax as kj`, `from kdtree_jax import attention`): catches `attention.describe_impl()`.
    A name assigned in a function shadows an outer import there (e.g. a local `model = CostModel(...)`)."""
    found = []

    def visit(scope, outer: dict[str, str]):
        nodes = list(_in_scope(scope))
        stored = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stored |= {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        aliases = {k: v for k, v in outer.items() if k not in stored}
        for n in nodes:
            aliases.update(_import_aliases(n))
        for n in nodes:
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases:
                found.append((aliases[n.value.id], n.attr, n.lineno))
            elif isinstance(n, _SCOPES):
                visit(n, aliases)

    visit(ast.parse(path.read_text(), str(path)), {})
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


SCRIPTS = sorted(BENCH.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_imports_resolve(path):
    missing = []
    for module, name, line in _imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: import {module} fails: {e}")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:  # `from pkg import submodule`
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{path.name}:{line}: {module} has no {name!r}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_module_attributes_exist(path):
    missing = [f"{path.name}:{line}: {module} has no {attr!r}" for module, attr, line in _module_attributes(path)
               if not hasattr(importlib.import_module(module), attr) and not _is_module(f"{module}.{attr}")]
    assert not missing, "\n".join(missing)


def test_checker_sees_a_removed_attribute(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import kdtree_jax as kj\nfrom kdtree_jax import attention\n\n"
                   "def f():\n    return attention.describe_impl(), kj.Kernels\n")
    assert sorted(_module_attributes(bad)) == [("kdtree_jax", "Kernels", 5),
                                               ("kdtree_jax.attention", "describe_impl", 5)]
    assert not hasattr(importlib.import_module("kdtree_jax.attention"), "describe_impl")


def test_checker_sees_a_removed_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kdtree_jax.attention import describe_impl\n")
    assert _imports(bad) == [("kdtree_jax.attention", "describe_impl", 2)]
