"""The package's layers (docs/development.md, "Layout"): common <- nn <- training <- interop <- the
command-line tools, data beside nn; and no import circle, counting imports inside functions. Read from
the import statements of every module (ast), not by importing them."""

import ast
import os

from jax_cache import ROOT

PACKAGE = os.path.join(ROOT, "deltares")
# What each sub-package may import of deltares (besides itself).
ALLOWED = {
    "common": set(),
    "nn": {"common"},
    "data": {"common"},
    "training": {"common", "nn", "data"},
    "interop": {"common", "nn", "data", "training"},
}
TOOLS = {"train", "eval", "generate", "convert", "aot", "bench", "analyze", "compare", "harness"}


def deltares_imports(path):
    """The deltares modules `path` imports (`deltares.x.y` as ('x', 'y'), `from deltares import x` as ('x',))."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("deltares.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "deltares":
            parts = tuple(node.module.split(".")[1:])
            found |= {parts} if parts else {(a.name,) for a in node.names}
    return found


def modules():
    for folder, _, files in os.walk(PACKAGE):
        if "hf_remote" in folder or "__pycache__" in folder:
            continue
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), PACKAGE)


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for rel in modules():
        layer = rel.split(os.sep)[0] if os.sep in rel else None
        for parts in deltares_imports(os.path.join(PACKAGE, rel)):
            target = parts[0]
            if layer is None:  # the top (tools, command_line) uses everything; the trainer no other tool
                if rel == "train.py" and target in TOOLS - {"train"}:
                    bad.append((rel, parts))
                continue
            # deltares.command_line is the command line's start (data.prepare's cli() imports it there)
            command_line_ok = parts == ("command_line",) and rel == os.path.join("data", "prepare.py")
            if target != layer and target not in ALLOWED[layer] and not command_line_ok:
                bad.append((rel, parts))
    assert not bad, bad


def test_the_top_level_holds_only_the_tools():
    top = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert top == TOOLS | {"__init__", "command_line"}, top
    assert {d for d in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, d)) and d != "__pycache__"} == {
        "common", "nn", "training", "data", "interop"}


def module_graph():
    """Each deltares module (dotted) and the deltares modules it imports anywhere in its text."""
    names = {}
    for rel in modules():
        dotted = "deltares." + rel[:-3].replace(os.sep, ".")
        names[dotted.removesuffix(".__init__")] = os.path.join(PACKAGE, rel)
    graph = {}
    for name, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deltares"):
                # `from a.b import c`: the module a.b.c where c is one, else a.b
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                            for a in node.names}
        graph[name] = {t for t in targets if t in names} - {name}
    return graph


def test_no_import_circle():
    """Modules import in one direction, counting the imports inside functions: a circle makes the
    order of imports matter and ties a schema to the command line."""
    graph, circles = module_graph(), []
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_the_kernel_package_imports_no_deltares():
    """kernels_pallas stands alone (its oracle is its own reference.py); only its benchmark's train-step
    table runs deltares' model."""
    kernels = os.path.join(ROOT, "kernels_pallas")
    bad = []
    for folder, _, files in os.walk(kernels):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and name != "bench.py" and deltares_imports(path):
                bad.append(os.path.relpath(path, ROOT))
    assert not bad, bad
