"""The house stays readable: hvd_topk/'s layers are folders (``LAYERS`` below, drawn in
docs/img/layers.png by scripts/draw_layers.py), imports go only to the same layer or below, only the
optimizer's factory reaches into auto/, the package root holds only the front doors, no file exceeds
300 lines and no class or function exceeds 120. Pure reading of the source; nothing is imported from
hvd_topk."""
import ast
import os

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "hvd_topk")
MAX_FILE_LINES = 300
MAX_UNIT_LINES = 120
MAX_ROOT_FILES = 6

# The layers, top to bottom: (title, [(box label, what it holds, its files or folders under hvd_topk/)]).
# A file imports only from its own layer and the layers below it. scripts/draw_layers.py draws this list.
LAYERS = [
    ("front doors (the package root)", [
        ("compression.py  TopKEF", "Horovod's Compressor", ["compression.py"]),
        ("powersgd.py  PowerSGD", "Horovod's Compressor,\nlow rank", ["powersgd.py"]),
        ("optimizer.py  DistributedOptimizer", "the factory; arguments.py:\nthe front doors' checks",
         ["optimizer.py", "arguments.py", "__init__.py"]),
        ("settings.py", "what the doors read:\nTopKSettings, PowerSGDSettings,\nOptimizerSettings", ["settings.py"]),
    ]),
    ("the step", [
        ("step/", "one synchronized step of either door:\ncoordinator, Horovod's overrides, DGC,\n"
                  "schedule, stats, checkpoints, elastic,\nthe Compressor doors' keys, token, step", ["step/"]),
        ("auto/", "communication='auto', adaptive ratio:\ntuner, plans, quality, trial, recheck,\ncostmodel, probe, measure",
         ["auto/"]),
    ]),
    ("transports/  (one Transport protocol: base.py)", [
        ("dense.py", "allreduce of\neverything", ["transports/dense.py", "transports/base.py",
                                                  "transports/__init__.py"]),
        ("artopk.py", "one leader's\nindex set: leaders.py,\nindex_sets.py",
         ["transports/artopk.py", "transports/leaders.py", "transports/index_sets.py"]),
        ("allgather.py", "every rank's\nown top-k", ["transports/allgather.py"]),
        ("split_reduce.py", "owners sum regions,\nglobal top-k:\nregions.py,\nsplit_phases.py",
         ["transports/split_reduce.py", "transports/regions.py", "transports/split_phases.py"]),
        ("hierarchical.py", "dense in a host,\nsplit_reduce across\nhosts: host_sets.py",
         ["transports/hierarchical.py", "transports/host_sets.py"]),
        ("collectives.py", "grouping, flags,\nagreement; fused.py:\none collective per\nbucket and phase",
         ["transports/collectives.py", "transports/fused.py"]),
        ("lowrank.py", "PowerSGD's\nlow-rank P, Q:\nlowrank_wire.py", ["transports/lowrank.py",
                                                                     "transports/lowrank_wire.py"]),
        ("build.py", "the one factory:\nsettings ->\ntransports", ["transports/build.py"]),
    ]),
    ("core/", [
        ("core/", "residuals (memory.py), exact top-k (sparsify.py), the packed\nmessage (codec.py), buckets "
                  "(buckets.py), sizes on the wire\n(wire.py), argument checks (validate.py)", ["core/"]),
    ]),
    ("Horovod 0.28.1, unpatched", [
        ("horovod.torch", "allreduce, allgather, alltoall, reducescatter, broadcast (Gloo or MPI)", []),
    ]),
]


# What only the factory (transports/build.py) constructs: the transports, their leaders, index sets,
# collectives and regions. Both front doors call it, so the two doors cannot wire them up differently.
FACTORY = os.path.join("transports", "build.py")
BUILT_BY_THE_FACTORY = {"ARTopk", "SparseAllgather", "SplitReduce", "Dense", "Hierarchical", "LowRank", "StarLeaders",
                        "VarLeaders", "IndexPipeline", "Collectives", "Regions"}


def _layers():
    return LAYERS


def _sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), PACKAGE)


def _layer_of(rel, placed):
    """The layer of a file under hvd_topk/: its own entry, else its folder's ("auto/")."""
    if rel in placed:
        return placed[rel]
    return placed.get(rel.split(os.sep)[0] + "/")


def test_the_package_root_holds_only_the_front_doors():
    root_files = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert len(root_files) <= MAX_ROOT_FILES, f"hvd_topk/ holds {root_files}: move the step's files to step/, " \
                                              "the core's to core/"


def _targets(rel, node):
    """The files under hvd_topk/ that a relative ``from ... import`` names."""
    base = os.path.dirname(rel)
    for _ in range(node.level - 1):
        base = os.path.dirname(base)
    stem = os.path.join(base, *node.module.split(".")) if node.module else base
    candidates = [stem] if node.module else [os.path.join(base, a.name) for a in node.names]
    for path in candidates:
        for target in (path + ".py", os.path.join(path, "__init__.py")):
            if os.path.exists(os.path.join(PACKAGE, target)):
                yield target
                break


def _relative_imports(rel):
    with open(os.path.join(PACKAGE, rel)) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield from _targets(rel, node)


def test_every_file_has_its_place_in_the_drawing():
    placed = {f: i for i, (_, boxes) in enumerate(_layers()) for _, _, files in boxes for f in files}
    missing = [rel for rel in _sources() if _layer_of(rel, placed) is None]
    assert not missing, f"add these to LAYERS (tests/test_layout.py) and redraw with scripts/draw_layers.py: {missing}"


def test_imports_go_to_the_same_layer_or_below():
    placed = {f: i for i, (_, boxes) in enumerate(_layers()) for _, _, files in boxes for f in files}
    upward = [(rel, target) for rel in _sources() for target in _relative_imports(rel)
              if _layer_of(target, placed) < _layer_of(rel, placed)]
    assert not upward, f"imports from a higher layer: {upward}"


def test_only_the_factory_imports_auto():
    outside = [(rel, target) for rel in _sources() if not rel.startswith("auto" + os.sep)
               for target in _relative_imports(rel) if target.startswith("auto" + os.sep)]
    assert {rel for rel, _ in outside} == {"optimizer.py"}, outside


def test_the_rule_can_fail():
    """The checks see an upward import: a transport importing the optimizer would be one."""
    node = ast.parse("from ..optimizer import DistributedOptimizer").body[0]
    assert list(_targets(os.path.join("transports", "dense.py"), node)) == ["optimizer.py"]


@pytest.mark.parametrize("rel", sorted(_sources()))
def test_files_and_units_are_small(rel):
    with open(os.path.join(PACKAGE, rel)) as f:
        source = f.read()
    assert source.count("\n") <= MAX_FILE_LINES, f"{rel}: more than {MAX_FILE_LINES} lines"
    long_units = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and
                  node.end_lineno - node.lineno + 1 > MAX_UNIT_LINES]
    assert not long_units, f"{rel}: {long_units} over {MAX_UNIT_LINES} lines"


def _constructions(source):
    """{(class, line)} of the calls in ``source`` that construct a class of BUILT_BY_THE_FACTORY, by its name,
    an attribute of that name or a name it was imported as."""
    tree = ast.parse(source)
    aliases = {a.asname: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for a in node.names if a.asname}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            name = aliases.get(name, name)
            if name in BUILT_BY_THE_FACTORY:
                found.add((name, node.lineno))
    return found


def test_only_the_factory_constructs_transports():
    outside = []
    for rel in sorted(_sources()):
        if rel != FACTORY:
            with open(os.path.join(PACKAGE, rel)) as f:
                outside += [(rel, name, line) for name, line in sorted(_constructions(f.read()))]
    assert not outside, f"only {FACTORY} (build_transports) may construct these: {outside}"


def test_the_factory_rule_can_fail():
    """The check sees a construction by name, by attribute and under an alias, and not a static call."""
    source = ("from .regions import Regions as R\n"
              "t = transports.SplitReduce(c, False, R(), 'n')\n"
              "owners = Regions.owners(i, b)\n")
    assert _constructions(source) == {("SplitReduce", 2), ("Regions", 2)}
