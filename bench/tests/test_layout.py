"""bench/'s shape: one harness, not a pile of scripts. At most 15 modules and 3.5k lines, one argparse
parser, no module importing another in a circle, no sys.path edits, imports at the top of modules
(an import inside a function only with a comment saying why), and nothing outside bench/ importing it:
tests/, hvd_topk/, testbed/ and examples/ stand without the benchmarks."""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
MODULES = sorted(glob.glob(os.path.join(BENCH, "*.py")))


def _tree(path):
    with open(path) as f:
        return ast.parse(f.read(), path)


def _name(path):
    return os.path.splitext(os.path.basename(path))[0]


def bench_imports(tree):
    """The bench modules a module imports (``from bench import x``, ``import bench.x``, ``from bench.x
    import y``), anywhere in it."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
    return out


def circles(graph):
    """Every import circle of ``graph`` (module -> modules it imports), each as a list of modules."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_size_and_module_count():
    lines = sum(len(open(p).read().splitlines()) for p in MODULES)
    assert len(MODULES) <= 15, [_name(p) for p in MODULES]
    assert lines <= 3500, lines
    too_long = [(_name(p), n) for p in MODULES if (n := len(open(p).read().splitlines())) > 300]
    assert not too_long


def test_exactly_one_argument_parser_and_no_sys_path_edits():
    parsers, edits = [], []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                parsers.append(_name(path))
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                edits.append(_name(path))
    assert parsers == ["__main__"]
    assert not edits


def test_no_import_circles_and_experiments_do_not_import_each_other():
    graph = {_name(p): bench_imports(_tree(p)) - {_name(p)} for p in MODULES}
    assert not circles(graph), circles(graph)
    # the harness's own parts; the rest (demo, selection, scale, peer_tests, ab, results_page) are
    # experiments beside it, and import nothing of bench but the manifest
    harness = {"__main__", "__init__", "tasks", "arms", "links", "runner", "figures", "report", "manifest"}
    for name, imported in graph.items():
        if name not in harness:
            assert imported <= {"manifest"}, (name, imported)


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert bench_imports(ast.parse("from bench import x, y\nimport bench.z\nfrom bench.w import f")) == \
        {"x", "y", "z", "w"}


def test_imports_inside_functions_say_why():
    """An import inside a function is allowed where it is heavy and optional, with a comment on its line."""
    silent = []
    for path in MODULES:
        lines = open(path).read().splitlines()
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) and "#" not in lines[inner.lineno - 1]:
                        silent.append(f"{_name(path)}:{inner.lineno}")
    assert not silent


@pytest.mark.parametrize("folder", ["tests", "hvd_topk", "testbed", "examples"])
def test_nothing_outside_bench_imports_it(folder):
    users = []
    for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
        tree = _tree(path)
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        if "bench" in roots:
            users.append(os.path.relpath(path, ROOT))
    assert not users
