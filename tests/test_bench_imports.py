"""Every benchmarks/*.py imports only names that exist: parsed with ast (lazy imports inside functions too),
so a removed engine name fails on CPU instead of on the GPU box."""

import ast
import importlib
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


def test_checker_sees_a_removed_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kdtree_jax.attention import describe_impl\n")
    assert _imports(bad) == [("kdtree_jax.attention", "describe_impl", 2)]
