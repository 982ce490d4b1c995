"""The package installs from a wheel and works outside the repository; importing it changes nothing.

`test_wheel_installs_and_runs_outside_the_repository` builds a wheel from the checkout and installs
it, without dependencies, into a fresh virtual environment whose only other packages are this
environment's (a `.pth` file names this environment's site-packages, so jax & co. are not
reinstalled). That still proves the package installs: the package's own files come only from the
wheel (the test checks that `deltares.__file__` lies inside the new environment), they are used
from a directory outside the repository with nothing of the checkout on the path, and the declared
dependencies are checked separately (`test_declared_dependencies_resolve_to_the_pins`: pip resolves
them, offline, against requirements.txt's pins).

`test_core_install_runs_the_layers_without_the_trainer` is the other side: an environment holding only
what `pip install .` without extras brings (the core dependencies and what they require, nothing of the
`train` extra) imports `deltares.nn` and runs its layers and model; a tool started there ends in one line.
"""

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import re
import sys
import sysconfig
import time
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

import deltares
from deltares import command_line
from tests.jax_cache import ROOT, SETTINGS

PACKAGE_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "deltares", "kernels_pallas", "experiments")
# Set by deltares/__init__.py (TPU_*) and deltares/aot.py (all four) on import before they left it.
TOOL_VARIABLES = ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
                  "ALLOW_MULTIPLE_LIBTPU_LOAD")


def _env(**extra) -> dict:
    """This process's environment without the checkout on the path and without the variables the
    tools set, plus the shared compilation cache."""
    env = {k: v for k, v in os.environ.items() if k not in TOOL_VARIABLES + ("PYTHONPATH",)}
    if command_line.tpu_chips_present():
        env["JAX_PLATFORMS"] = "cpu"  # keep the tests off the chips; libtpu is quiet on a TPU machine anyway
    env.update(SETTINGS, **extra)
    return env


def _run(cmd, cwd, env, timeout=600, status=0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == status, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _package_files(directory: str) -> set[str]:
    """Files under `directory` (relative to it), without bytecode."""
    out = set()
    for base, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out |= {os.path.relpath(os.path.join(base, f), directory) for f in files if not f.endswith((".pyc", ".pyo"))}
    return out


def _pins() -> str:
    """The pinned set this environment holds: requirements.txt (Python 3.11, jax 0.10) or
    requirements-py312.txt (Python 3.12, jax 0.12), whichever pins the installed jax."""
    pin = f"jax=={importlib.metadata.version('jax')}"
    for name in ("requirements.txt", "requirements-py312.txt"):
        with open(os.path.join(ROOT, name)) as f:
            if pin in (line.strip() for line in f):
                return os.path.join(ROOT, name)
    raise AssertionError(f"no requirements file pins {pin}")


def _can_build_wheels_here() -> bool:
    """Whether this environment's setuptools builds this wheel: 77 or newer (pyproject's SPDX `license`,
    PEP 639; it builds wheels itself). Else pip builds it in an isolated environment."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel built from a copy of the checkout's package inputs (no build/ or egg-info left in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGE_INPUTS:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    isolation = ["--no-build-isolation"] if _can_build_wheels_here() else []  # else pip fetches setuptools
    start = time.perf_counter()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp / "dist"), str(src)],
         cwd=tmp, env=_env())
    print(f"wheel built in {time.perf_counter() - start:.1f} s")
    (built,) = (tmp / "dist").glob("deltares-*.whl")
    return str(built)


def test_wheel_holds_every_package_file_and_the_experiments(wheel):
    """Every file under deltares/ and kernels_pallas/ (modules, the corpus, the tokenizer, remote-code
    templates, anything added later) and every experiment file (as deltares/experiments/) ships."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("deltares", "kernels_pallas"):
        missing = {f for f in _package_files(os.path.join(ROOT, package)) if f"{package}/{f}" not in names}
        assert not missing, f"not in the wheel: {sorted(missing)}"
    experiments = {f for f in _package_files(os.path.join(ROOT, "experiments")) if f.endswith(".py")}
    assert experiments and {f"deltares/experiments/{f}" for f in experiments} <= names
    assert {"deltares/data/assets/mobydick.txt.gz", "deltares/data/assets/gpt2_tokenizer.json.gz"} <= names
    assert {"deltares/nn/model.py", "deltares/training/steps.py", "deltares/data/dataset.py", "deltares/interop/hf.py",
            "deltares/interop/hf_remote/modeling_deltares_qwen3.py", "deltares/train.py"} <= names  # the layout by role
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "experiments/"))]
    metadata = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "deltares-train = deltares.train:cli" in scripts and "deltares-harness = deltares.harness:main" in scripts
    # The license: its SPDX name in the metadata, its text in the wheel
    info = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in info.splitlines(), info[:2000]
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_declared_dependencies_resolve_to_the_pins(wheel):
    """pip resolves the wheel with every extra, constrained to requirements.txt's pins (or
    requirements-py312.txt's, whichever this environment holds; and the test
    pins), from the installed packages alone (--no-index): a declared range that excluded a pin would
    need a download and fail; nothing but deltares itself would be installed."""
    proc = _run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet", "--report", "-",
                 f"{wheel}[test]", "-c", _pins(),
                 "-c", os.path.join(ROOT, "requirements-test.txt")], cwd=os.path.dirname(wheel), env=_env())
    report = json.loads(proc.stdout)
    assert [item["metadata"]["name"] for item in report["install"]] == ["deltares"]


def test_wheel_installs_and_runs_outside_the_repository(wheel, tmp_path):
    start = time.perf_counter()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_dir = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}  # jax & co. (and pip)
    with open(os.path.join(site_dir, "_dependencies.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel],
         cwd=tmp_path, env=_env())
    work = tmp_path / "elsewhere"  # no experiments/, no deltares/ here
    work.mkdir()

    api = _run([python, "-c", """if True:
        import json, jax.numpy as jnp, numpy as np
        import deltares, kernels_pallas
        from deltares import command_line
        from deltares.interop import hf
        from deltares.training.experiment import experiment
        from deltares.data.tokenizer import load_tokenizer
        from deltares.nn.routing import depth_route
        from deltares.train import train
        from kernels_pallas.depth_route import depth_route as kernel_route
        sources, valid = jnp.arange(24.0).reshape(2, 1, 3, 4) / 24, jnp.array([True, True])
        out = depth_route(sources, valid, jnp.zeros(4), jnp.ones(4))
        np.testing.assert_allclose(out, kernel_route(sources, valid, jnp.zeros(4), jnp.ones(4)), atol=1e-6)
        np.testing.assert_allclose(out, sources.mean(0), atol=1e-6)  # a zero query: uniform weights
        import glob, importlib.machinery, os
        for path in sorted(glob.glob(os.path.join(command_line.experiments_dir(), "*.py"))):  # as --config loads them
            module = importlib.machinery.SourceFileLoader("config", path).load_module()
            assert module.get_config().model.n_layers > 0, path
        print(json.dumps(dict(deltares=deltares.__file__, kernels=kernels_pallas.__file__,
                              experiments=command_line.experiments_dir(), gpt2=len(load_tokenizer("gpt2").encode("Call me Ishmael.")))))
    """], cwd=work, env=_env(JAX_PLATFORMS="cpu"))  # a library user's program: libtpu is theirs to quiet
    found = json.loads(api.stdout.strip().splitlines()[-1])
    venv_real = os.path.realpath(venv)
    for key in ("deltares", "kernels", "experiments"):
        assert os.path.realpath(found[key]).startswith(venv_real + os.sep), (key, found[key])
    assert found["gpt2"] > 0

    # The README's spelling of the debug experiment: no experiments/ here, the shipped file is found.
    train = _run([python, "-m", "deltares.train", "--config", "experiments/debug.py", "--workdir", str(work / "run"),
                  "--config.train.steps=2"], cwd=work, env=_env())
    assert "step 2: validation loss" in train.stdout
    assert os.path.exists(work / "run" / "metrics.jsonl")
    if not command_line.tpu_chips_present():  # JAX_PLATFORMS unset: libtpu probes for a TPU, quietly
        assert "TPU" not in train.stderr, train.stderr[-2000:]

    # absl's --help exits with status 1; the console script shows what `python -m deltares.train --help` shows
    script = _run([str(venv / "bin" / "deltares-train"), "--help"], cwd=work, env=_env(), status=1)
    assert "Train a deltares model" in script.stdout and "--workdir: Run directory" in script.stdout
    print(f"venv, install, API, 2-step debug training, console script: {time.perf_counter() - start:.1f} s")


def test_import_changes_no_environment_variable(tmp_path):
    """`import deltares` leaves os.environ as it was; so does importing every module of deltares and
    kernels_pallas, measured after the third-party packages they use are imported (jax itself sets
    TPU_LIBRARY_PATH and others, lm-eval HF_XET_HIGH_PERFORMANCE: not ours to change)."""
    code = """if True:
        import importlib, json, os, pkgutil
        def changed(before):
            return sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
        before = dict(os.environ)
        import deltares
        package = changed(before)
        import jax, jax.experimental.pallas, flax, optax, orbax.checkpoint, grain, lm_eval, tokenizers, tensorboardX
        before = dict(os.environ)
        import kernels_pallas
        names = [m.name for p in (deltares, kernels_pallas) for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")
                 if not m.name.startswith("deltares.interop.hf_remote")]  # PyTorch templates, not imported by deltares
        for name in names:
            importlib.import_module(name)
        print(json.dumps(dict(package=package, modules=changed(before), names=names)))
    """
    proc = _run([sys.executable, "-c", code], cwd=tmp_path, env=_env(PYTHONPATH=ROOT))
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"deltares.train", "deltares.aot", "deltares.harness", "deltares.command_line"} <= set(found["names"])
    assert found["package"] == [] and found["modules"] == [], found


def test_config_names_resolve_to_the_shipped_experiments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no experiments/ here
    shipped = os.path.join(command_line.experiments_dir(), "debug.py")
    assert os.path.isfile(shipped)
    for given, expected in [
        ("debug", shipped),
        ("debug:delta,block_layers=1", shipped + ":delta,block_layers=1"),
        ("debug.py:baseline", shipped + ":baseline"),
        ("experiments/debug.py:delta_block", shipped + ":delta_block"),
        ("nosuch:delta", "nosuch:delta"),  # left for the tool to report
        ("other/debug.py", "other/debug.py"),  # a path elsewhere is never redirected
    ]:
        assert command_line.resolve_config(given) == expected, given
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "debug.py").write_text("")
    assert command_line.resolve_config("experiments/debug.py:delta") == "experiments/debug.py:delta"  # a file here wins

    argv = ["train", "--config", "tiny:delta", "--config.train.steps=2", "--config=debug", "--", "--config", "debug"]
    tiny = os.path.join(command_line.experiments_dir(), "tiny.py")
    assert command_line.resolve_config_args(argv) == [
        "train", "--config", tiny + ":delta", "--config.train.steps=2", f"--config={shipped}", "--", "--config", "debug"]


# ----------------------------------------------------------------------------- the core install


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(requirements) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `requirements` need, by normalized name: each requirement and,
    recursively, what its installed distribution requires (the extras a requirement names included;
    requirements behind another extra, or whose marker does not hold here, left out)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [(Requirement(r) if isinstance(r, str) else r, "") for r in requirements]
    seen = set()
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        dist = importlib.metadata.distribution(req.name)
        found[_key(req.name)] = dist
        for wanted in ("", *sorted(req.extras)):
            if (_key(req.name), wanted) in seen:
                continue
            seen.add((_key(req.name), wanted))
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return found


def _core_environment(tmp_path) -> tuple[str, dict]:
    """A virtual environment (no pip) whose site-packages holds only the core dependencies' closure, as
    links to this environment's files (each distribution's files, as its RECORD lists them, so that a
    folder two distributions share brings only the closure's part), and links to the checkout's
    `deltares` and `kernels_pallas`. Returns its python and the closure."""
    venv = tmp_path / "core"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_dir = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    closure = requirement_closure(_pyproject()["dependencies"])
    for dist in closure.values():
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:  # console scripts; bytecode
                continue
            target = os.path.join(site_dir, *file.parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.lexists(target):
                os.symlink(os.path.realpath(dist.locate_file(file)), target)
    for package in ("deltares", "kernels_pallas"):
        os.symlink(os.path.join(ROOT, package), os.path.join(site_dir, package))
    return str(venv / "bin" / "python"), closure


def test_the_train_extra_is_what_the_tools_check():
    """pyproject's `train` extra and deltares.TRAIN_MODULES (what a tool started without them names)
    list the same distributions, none of them a core dependency; `all` includes `train`."""
    project = _pyproject()
    train = {str(Requirement(r).name) + "".join(f"[{e}]" for e in sorted(Requirement(r).extras))
             for r in project["optional-dependencies"]["train"]}
    assert train == set(deltares.TRAIN_MODULES.values())
    core = {_key(Requirement(r).name) for r in project["dependencies"]}
    assert core == {"jax", "flax", "numpy", "ml-collections", "absl-py"}, core
    assert not core & {_key(Requirement(r).name) for r in project["optional-dependencies"]["train"]}
    assert "train" in Requirement(project["optional-dependencies"]["all"][0]).extras


def test_core_install_runs_the_layers_without_the_trainer(tmp_path):
    """`import deltares.nn` and its layers in an environment of the core closure alone: the layers with
    ml-collections hidden too (they need only jax, flax and numpy), then `model_config` and a small
    `Transformer`. The trainer's own packages are absent there (a trainer import on the layers' path
    fails this test), and a tool started there says in one line what is missing."""
    start = time.perf_counter()
    python, closure = _core_environment(tmp_path)
    # What the core brings with flax (flax itself requires optax and orbax-checkpoint) is allowed; the
    # rest of the train extra must not be in the closure, or this environment proves nothing.
    trainer_only = {"grain", "tokenizers", "safetensors", "tqdm", "tensorboardx"}
    assert not trainer_only & set(closure), sorted(trainer_only & set(closure))
    assert {"jax", "jaxlib", "flax", "numpy", "ml-collections"} <= set(closure)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = _env(JAX_PLATFORMS="cpu")
    proc = _run([python, "-I", "-c", """if True:
        import importlib.util, json, sys
        absent = [m for m in ("grain", "tokenizers", "safetensors", "tqdm", "tensorboardX", "pytest", "lm_eval")
                  if importlib.util.find_spec(m) is not None]
        assert not absent, f"not core packages, importable: {absent}"
        sys.modules["ml_collections"] = None  # the layers without it: jax, flax and numpy
        import jax, jax.numpy as jnp, numpy as np
        import deltares.nn
        from deltares.nn import DepthRouter, DepthRouting, DepthStack, depth_route
        from deltares.nn.routing import inv_rms
        sources = jax.random.normal(jax.random.key(0), (3, 2, 4, 8))
        valid = jnp.array([True, True, False])
        out = depth_route(sources, valid, jnp.zeros(8), jnp.ones(8))
        np.testing.assert_allclose(out, sources[:2].mean(0), atol=1e-6)  # a zero query: uniform over the valid
        router = DepthRouter()
        variables = router.init(jax.random.key(1), sources, inv_rms(sources), valid)
        routed, weights = router.apply(variables, sources, inv_rms(sources), valid)
        np.testing.assert_allclose(routed, out, atol=1e-6)
        layers = sorted({m.split(".")[0] for m in sys.modules if sys.modules[m] is not None})
        del sys.modules["ml_collections"]
        from deltares.nn import Transformer, model_config
        cfg = model_config(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                           dtype="float32", residual=dict(mode="delta_block", block_layers=1))
        tokens = jnp.zeros((1, 4), jnp.int32)
        model = Transformer(cfg)
        logits = model.apply(model.init(jax.random.key(2), tokens), tokens)
        assert logits.shape == (1, 4, 32), logits.shape
        print(json.dumps(dict(layers=layers, deltares=deltares.__file__)))
    """], cwd=work, env=env)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "ml_collections" not in found["layers"], found["layers"]
    assert os.path.realpath(found["deltares"]).startswith(os.path.realpath(ROOT) + os.sep)

    # A tool without the train extra: one line naming what is missing, no traceback
    tool = _run([python, "-I", "-m", "deltares.train", "--help"], cwd=work, env=env, status=1)
    lines = tool.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in tool.stderr, tool.stderr
    assert "grain" in lines[0] and "tokenizers" in lines[0] and '".[train]"' in lines[0], lines[0]
    # The examples (files of a checkout, run from its root) say the same in one line
    for example in ("gpt_linen", "gpt_nnx"):
        run = _run([python, "-m", f"examples.{example}"], cwd=ROOT, env=env, status=1)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: examples/{example}.py") and "Traceback" not in \
            run.stderr, run.stderr
        assert "grain" in lines[0] and "the `train` extra" in lines[0] and '".[train]"' in lines[0], lines[0]
    print(f"core environment ({len(closure)} distributions), layers, model, a tool: {time.perf_counter() - start:.1f} s")


def test_citation_file_cites_the_paper_and_this_version():
    """CITATION.cff (CFF 1.2.0; `cffconvert --validate` passed on it, 2026-12-05): the software, with the
    package's version and license, and the paper as the preferred citation."""
    import yaml

    with open(os.path.join(ROOT, "CITATION.cff")) as f:
        cff = yaml.safe_load(f)
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["message"] and cff["authors"]
    assert cff["version"] == deltares.__version__
    assert cff["license"] == _pyproject()["license"] == "Apache-2.0"
    paper = cff["preferred-citation"]
    assert paper["title"] == "Delta Attention Residuals" and paper["year"] == 2026
    assert [a["family-names"] for a in paper["authors"]] == ["Luo", "Cai", "Hu"]
