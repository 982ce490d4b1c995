"""The documentation holds together: every relative link of the markdown pages resolves (to a file,
and to a heading where it names one), and the generated reference pages are current.

(That every command and Python snippet the pages print runs is tests/test_documented_commands.py.)
"""

from __future__ import annotations

import glob
import os
import re
import sys
import types

from tests.jax_cache import ROOT
from tests.reference_pages import stale

PAGES = ("README.md", "CHANGELOG.md", "launch/README.md", "examples/README.md", "docs/**/*.md")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def pages() -> list[str]:
    return sorted({os.path.relpath(p, ROOT) for pattern in PAGES
                   for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)})


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links reduced to their text, lower case, punctuation dropped
    (letters, digits, `_` and `-` kept), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    with open(path) as f:
        text = f.read()
    out, seen = set(), {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not fenced:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: str) -> list[str]:
    """`page:line: target (why)` for every relative link of `page` that does not resolve."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    out = []
    for number, line in prose(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(ROOT, page)
            if not full.startswith(ROOT + os.sep) and full != ROOT:
                out.append(f"{page}:{number}: {target} (outside the repository)")
            elif not os.path.exists(full):
                out.append(f"{page}:{number}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                out.append(f"{page}:{number}: {target} (no heading #{anchor} in {os.path.relpath(full, ROOT)})")
    return out


def test_every_relative_link_resolves():
    found = pages()
    assert "README.md" in found and "docs/explanations/modes.md" in found, found
    broken = [b for page in found for b in broken_links(page)]
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_link_checking_finds_files_and_headings(tmp_path, monkeypatch):
    assert slug("Will it fit? Ahead-of-time proof on a CPU") == "will-it-fit-ahead-of-time-proof-on-a-cpu"
    assert slug("`deltares.compare`: a [results](x.md) table") == "deltarescompare-a-results-table"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#two-words) [ok](#top) `[not](a link)`\n"
        "[gone](docs/b.md) [bad](docs/a.md#not-a-heading) [web](https://example.com/x.md)\n\n# Top\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert [b.split(": ", 1)[1] for b in broken_links("README.md")] == [
        "docs/b.md (no such file)", "docs/a.md#not-a-heading (no heading #not-a-heading in docs/a.md)"]


def test_generated_reference_pages_are_current():
    differ = stale(ROOT)
    assert not differ, (f"{differ} differ from what the schema and the tools' --help give: run "
                        "`python -m tests.reference_pages` from the repository root and commit the pages")


# ----------------------------------------------------------------------------- the API reference

API_PAGES = os.path.join("docs", "reference", "api")


def _module_all(path: str) -> list[str]:
    import ast

    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"no __all__ in {path}")


def test_api_reference_has_a_page_per_public_name():
    """Every name of `deltares.nn.__all__` and `deltares.nn.nnx.__all__` is documented by a `::: ` directive of
    docs/reference/api/ (mkdocstrings renders it from the docstring), each page is in mkdocs.yml's nav and
    linked from the reference's index page, and the docs index links the reference."""
    directives = {}
    for page in sorted(glob.glob(os.path.join(ROOT, API_PAGES, "*.md"))):
        with open(page) as f:
            for line in f:
                if line.startswith("::: "):
                    directives[line[4:].strip()] = os.path.basename(page)
    # deltares.nn re-exports these from their modules: the directive may name either
    expected = {f"deltares.nn.{name}" for name in _module_all("deltares/nn/__init__.py")}
    expected |= {f"deltares.nn.nnx.{name}" for name in _module_all("deltares/nn/nnx.py")}
    documented = {re.sub(r"^deltares\.nn\.config\.", "deltares.nn.", name) for name in directives}
    missing = sorted(expected - documented)
    assert not missing, f"public names without a page in {API_PAGES}: {missing}"
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = f.read()
    with open(os.path.join(ROOT, API_PAGES, "index.md")) as f:
        index = f.read()
    for page in set(directives.values()):
        assert re.search(rf"^\s*- {re.escape(page)}$", config, re.M), f"{page} is not in mkdocs.yml's nav"
        assert f"]({page})" in index, f"{page} is not linked from {API_PAGES}/index.md"
    with open(os.path.join(ROOT, "docs", "README.md")) as f:
        assert "](reference/api/index.md)" in f.read()


# ----------------------------------------------------------------------------- what a pip user has

# Pages for someone working in a checkout (the tests, the launch scripts and the examples are files of the
# repository, not of the package): they may tell the reader to run a test file anywhere. A user page may
# name a test file as where a claim is checked; a command that runs one (pytest, or a tool of tests/ such
# as the benchmarks) must say, within three lines, that it runs in a checkout.
CHECKOUT_PAGES = ("docs/development.md", "launch/README.md", "examples/README.md", "CHANGELOG.md")
RUNS_A_TEST = re.compile(r"\bpytest\b[^`\n]*\btests/|python3? (?:-m tests\.|tests/)")


def commands_of_test_files_outside_a_checkout(page: str) -> list[str]:
    """`page:line: text` for each line of a user page that runs a file of tests/ with no "checkout" near it."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().splitlines()
    out = []
    for i, line in enumerate(lines):
        if RUNS_A_TEST.search(line) and not line.startswith("<!-- Generated by"):
            if not any("checkout" in near for near in lines[max(0, i - 3):i + 4]):
                out.append(f"{page}:{i + 1}: {line.strip()}")
    return out


def test_user_pages_run_test_files_only_in_a_checkout(tmp_path, monkeypatch):
    found = [hit for page in pages() if page not in CHECKOUT_PAGES and not page.startswith("docs/results/")
             for hit in commands_of_test_files_outside_a_checkout(page)]
    assert not found, ("user pages that send the reader to run a file of tests/ without saying it is in a checkout "
                       "(a pip user has no tests/):\n" + "\n".join(found))
    # the check finds such a line, and accepts it with the checkout said
    (tmp_path / "a.md").write_text("# A\n\nRun `python -m pytest tests/test_x.py`.\n\n\n\n\n"
                                   "From a checkout:\n\n```bash\npython -m tests.faults\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert commands_of_test_files_outside_a_checkout("a.md") == ["a.md:3: Run `python -m pytest tests/test_x.py`."]


# ----------------------------------------------------------------------------- the API reference's contents

SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Raises|Example|Examples):\s*$")


def _documented(doc: str, section: str) -> set:
    """The names a Google-style docstring section lists (`name: ...`, `*args: ...`)."""
    names, inside = set(), False
    for line in (doc or "").splitlines():
        head = SECTION.match(line.strip())
        if head:
            inside = head.group(1) == section and not line.startswith(" ")
            continue
        if inside and line and not line.startswith(" "):
            inside = False
        match = re.match(r"^ {4}(\*{0,2}\w+)(?: \([^)]*\))?:", line) if inside else None
        if match:
            names.add(match.group(1))
    return names


def _api_objects():
    """(directive, object) of every `::: ` directive of the API pages."""
    import importlib

    out = []
    for page in sorted(glob.glob(os.path.join(ROOT, API_PAGES, "*.md"))):
        with open(page) as f:
            for line in f:
                if line.startswith("::: "):
                    module, _, name = line[4:].strip().rpartition(".")
                    out.append((line[4:].strip(), getattr(importlib.import_module(module), name)))
    return out


def _signature_names(fn) -> set:
    import inspect

    names = set()
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls"):
            continue
        names.add({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return names


def test_api_reference_describes_every_argument_and_runs_an_example():
    """Each documented class and function of the API pages describes every argument of its signature
    (functions and methods: an `Args:` section; a linen Module's fields: `Attributes:`) and holds an
    example (a ```python block of its docstring, or of its page), which runs here as printed."""
    import inspect
    import textwrap

    import flax.linen as nn

    missing, examples = [], []
    for directive, obj in _api_objects():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # the mode names: their page holds the example (tests/test_documented_commands.py runs it)
        doc = inspect.getdoc(obj) or ""
        if inspect.isclass(obj) and issubclass(obj, nn.Module):
            fields = {f for f in obj.__dataclass_fields__ if f not in ("parent", "name")}
            missing += [f"{directive}: field {f}" for f in sorted(fields - _documented(doc, "Attributes"))]
        elif inspect.isclass(obj):
            init = obj.__init__
            if not getattr(init, "__dataclass_fields__", None) and "__init__" in vars(obj) or hasattr(obj, "__dataclass_fields__"):
                wanted = _signature_names(obj) - {"rngs"} if hasattr(obj, "__dataclass_fields__") else _signature_names(init)
                missing += [f"{directive}: {p}" for p in sorted(wanted - _documented(doc, "Args"))]
        else:
            missing += [f"{directive}: {p}" for p in sorted(_signature_names(obj) - _documented(doc, "Args"))]
        methods = [(n, m) for n, m in vars(obj).items() if inspect.isfunction(m) and m.__qualname__.startswith(
            obj.__name__ + ".") and (n == "__call__" or not n.startswith("_"))] if inspect.isclass(obj) else []
        for name, method in methods:
            wanted = _signature_names(method)
            if wanted:
                missing += [f"{directive}.{name}: {p}" for p in sorted(wanted - _documented(inspect.getdoc(method), "Args"))]
        blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
        if not blocks:
            missing.append(f"{directive}: no example (a ```python block in its docstring)")
        examples += [(directive, textwrap.dedent(code)) for code in blocks]
    assert not missing, "arguments or examples the API reference lacks:\n" + "\n".join(missing)
    for directive, code in examples:  # each in a module of its own, as a script would be (dataclasses look it up)
        module = types.ModuleType("deltares_api_example")
        sys.modules[module.__name__] = module
        try:
            exec(compile(code, f"<example of {directive}>", "exec"), module.__dict__)
        finally:
            del sys.modules[module.__name__]
