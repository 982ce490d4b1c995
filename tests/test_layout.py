"""The package's layers (docs/development.md, "Layout"): nn <- training <- interop <- the command-line tools,
data beside them. Read from the import statements of every module (ast), not by importing them."""

import ast
import os

from jax_cache import ROOT

PACKAGE = os.path.join(ROOT, "deltares")
# What each sub-package may import of deltares (besides itself).
ALLOWED = {
    "nn": set(),
    "data": set(),
    "training": {"nn", "data"},
    "interop": {"nn", "data", "training"},
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
            if target != layer and target not in ALLOWED[layer] and parts != ("command_line",):
                bad.append((rel, parts))
    assert not bad, bad


def test_the_top_level_holds_only_the_tools():
    top = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert top == TOOLS | {"__init__", "command_line"}, top
    assert {d for d in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, d)) and d != "__pycache__"} == {
        "nn", "training", "data", "interop"}


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
