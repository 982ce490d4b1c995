"""Outputs never land on inputs (deltares.common.outputs.check_output, issue 48): every command that writes
(prepare, convert --out and --out_workdir, compare, analyze, train's --workdir) x every misplaced output
(equal to, inside, containing an input; a link to one, a link loop, a dangling link; onto a run, a dataset,
a model, into their folders, a folder holding one), each refused in one line before anything is written,
with or without --overwrite: every file, folder and link of the test's world is hashed before and after.
The commands are called in-process, as their command lines call them; the overwrites that are allowed
(through a link: the target replaced whole, the link kept) run to the end and are checked against
references written without a link."""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
from contextlib import redirect_stderr

import pytest

from conftest import TINY_HF
from debug_runs import describe, module_cmd, tree_digest
from deltares.analyze import AnalysisError, analyze, check_analysis_out
from deltares.common.outputs import OutputError
from deltares.compare import check_outputs
from deltares.convert import convert
from deltares.data import paths
from deltares.data.documents import DataError
from deltares.data.prepare import prepare
from deltares.training.workdir import WorkdirError, check_workdir
from jax_cache import ENV, ROOT
from test_data import make_docs, write_corpus

REFUSED = (DataError, OutputError, AnalysisError, WorkdirError, FileExistsError)


def snapshot(root) -> dict:
    """Every entry under `root`: a file's sha256, a folder, a link and where it points."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link -> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "folder"
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def fake_run(path):
    """A run directory as the trainer leaves it, as far as a command that must not write there can tell."""
    os.makedirs(os.path.join(path, "checkpoints", "30"))
    open(os.path.join(path, "checkpoints", "30", "state"), "w").write("weights")
    open(os.path.join(path, "metrics.jsonl"), "w").write('{"step": 30, "loss": 1.0}\n')


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Sources, a dataset prepared from one of them (and a copy), a run, a folder holding another run, a
    Hugging Face model, other files, and links to them (and a loop, and a link to nothing)."""
    w = tmp_path_factory.mktemp("world")
    os.makedirs(w / "src")
    write_corpus(w / "src" / "a.txt", make_docs(30, 0, "a"))
    write_corpus(w / "src" / "b.txt", make_docs(30, 1, "b"))
    prepare(str(w / "src" / "a.txt"), "bytes", str(w / "data" / "ds"), val_fraction=0.2, progress=False)
    shutil.copytree(w / "data" / "ds", w / "data" / "ds2")
    fake_run(w / "runs" / "r")
    fake_run(w / "holder" / "r2")
    shutil.copytree(TINY_HF, w / "model")
    os.makedirs(w / "other")
    open(w / "other" / "notes.txt", "w").write("a user's notes")
    for name, target in (("link_run", "runs/r"), ("link_ds", "data/ds"), ("link_model", "model"),
                         ("link_file", "other/notes.txt"), ("loop", "loop"), ("dangling", "nowhere")):
        os.symlink(w / target, w / name)
    return w


def prepare_cmd(w, out, overwrite):
    prepare(f"{w}/src/a.txt,{w}/src/b.txt", "bytes", out, val_fraction=0.2, progress=False, overwrite=overwrite)


COMMANDS = {
    "prepare": prepare_cmd,
    "convert --hf": lambda w, out, ow: convert(hf_dir=f"{w}/model", out=out, overwrite=ow),
    "convert --checkpoint": lambda w, out, ow: convert(checkpoint=f"{w}/runs/r", out=out, overwrite=ow),
    "convert --out_workdir": lambda w, out, ow: convert(hf_dir=f"{w}/model", out_workdir=out, overwrite=ow),
    "compare": lambda w, out, ow: check_outputs([f"{w}/runs/r"], {"--out": out}, ow),
    "analyze": lambda w, out, ow: analyze([f"{w}/runs/r"], out, data=f"{w}/data/ds"),
    "train": lambda w, out, ow: check_workdir(out),  # its input: config.data.dataset = data/ds
}

# (command, where the output goes, --overwrite, what the one line says)
CASES = [
    ("prepare", "src/a.txt", True, "is also what this command reads"),
    ("prepare", "src/a.txt/x", True, "is inside the input"),
    ("prepare", "src", True, "contains the input"),
    ("prepare", "link_run", True, "(a link to {w}/runs/r) holds a run, which this command does not replace"),
    ("prepare", "loop", True, "leads back to itself"),
    ("prepare", "dangling", True, "which does not exist"),
    ("prepare", "runs/r", True, "holds a run, which this command does not replace"),
    ("prepare", "data/ds", False, "prepared from other input"),
    ("prepare", "model", True, "holds a Hugging Face model, which this command does not replace"),
    ("prepare", "runs/r/checkpoints/new", True, "is inside a run ({w}/runs/r)"),
    ("prepare", "data/ds/sub", True, "is inside a dataset ({w}/data/ds)"),
    ("prepare", "holder", True, "holds a run ({w}/holder/r2)"),
    ("prepare", "other/notes.txt", True, "is a file"),
    ("convert --hf", "model", True, "is also what this command reads"),
    ("convert --hf", "model/sub", True, "is inside the input"),
    ("convert --hf", ".", True, "contains the input"),
    ("convert --hf", "link_model", True, "is also what this command reads"),
    ("convert --hf", "link_ds", True, "holds a dataset, which this command does not replace"),
    ("convert --hf", "runs/r", True, "holds a run, which this command does not replace"),
    ("convert --hf", "data/ds", True, "holds a dataset, which this command does not replace"),
    ("convert --hf", "runs/r/checkpoints", True, "is inside a run ({w}/runs/r)"),
    ("convert --hf", "holder", True, "holds a run ({w}/holder/r2)"),
    ("convert --hf", "loop", True, "leads back to itself"),
    ("convert --checkpoint", "runs/r", True, "is also what this command reads"),
    ("convert --checkpoint", "link_run", True, "is also what this command reads"),
    ("convert --checkpoint", "runs/r/checkpoints/30", True, "is inside the input"),
    ("convert --checkpoint", "holder/r2", True, "holds a run, which this command does not replace"),
    ("convert --checkpoint", "runs", True, "contains the input"),
    ("convert --out_workdir", "runs/r", True, "holds a run, which this command does not replace"),
    ("convert --out_workdir", "model", True, "is also what this command reads"),
    ("convert --out_workdir", "data/ds/run", True, "is inside a dataset"),
    ("compare", "runs/r", True, "is also what this command reads"),
    ("compare", "runs/r/metrics.jsonl", True, "is inside the input"),
    ("compare", "holder/r2/metrics.jsonl", True, "is inside a run ({w}/holder/r2)"),
    ("compare", "data/ds/meta.json", True, "is inside a dataset"),
    ("compare", "model/config.json", True, "is inside a Hugging Face model"),
    ("compare", "other/notes.txt", False, "exists; pass --overwrite to replace it"),
    ("compare", "link_file", False, "exists; pass --overwrite to replace it"),
    ("compare", "other", True, "is a folder"),
    ("compare", "loop", True, "leads back to itself"),
    ("analyze", "runs/r", True, "is also what this command reads"),
    ("analyze", "runs/r/checkpoints", True, "is inside the input"),
    ("analyze", "link_ds", True, "is also what this command reads"),
    ("analyze", "data/ds2", True, "is a dataset"),
    ("analyze", "data/ds2/train", True, "is inside a dataset"),
    ("analyze", "model", True, "is a Hugging Face model"),
    ("analyze", "holder/r2", True, "is a run; write into a folder of its own"),
    ("analyze", "other/notes.txt", True, "is a file"),
    ("train", "data/ds", True, "holds a dataset, not a run"),
    ("train", "data/ds/run", True, "is inside a dataset"),
    ("train", "model", True, "holds a Hugging Face model, not a run"),
    ("train", "runs/r/checkpoints/run", True, "is inside a run"),
    ("train", "data", True, "not a run"),
]


@pytest.mark.parametrize("command, where, overwrite, says", CASES,
                         ids=[f"{c}:{w}{':overwrite' if o else ''}" for c, w, o, _ in CASES])
def test_a_misplaced_output_is_refused_before_anything_is_written(world, command, where, overwrite, says):
    before = snapshot(world)
    out = os.path.normpath(os.path.join(world, where))
    with pytest.raises(REFUSED) as err:
        COMMANDS[command](world, out, overwrite)
    message = str(err.value)
    assert "\n" not in message and says.format(w=world) in message, message
    assert snapshot(world) == before


@pytest.mark.parametrize("command, where", [("analyze", "runs/r/analysis"), ("compare", "runs/r/results.md"),
                                            ("train", "runs/r/finetune"), ("compare", "other/new.md")])
def test_a_new_entry_directly_in_a_run_is_a_place_to_write(world, command, where):
    """analyze's default `<run>/analysis`, a table beside a run's files, a run directly in a run."""
    out = os.path.join(world, where)
    check = {"analyze": lambda: check_analysis_out(out, [f"{world}/runs/r"], None),
             "compare": lambda: check_outputs([f"{world}/runs/r"], {"--out": out}, False)["--out"],
             "train": lambda: check_workdir(out) or out}[command]
    assert check() == out


def test_overwrite_through_a_link_replaces_the_target_whole_and_keeps_the_link(tmp_path):
    """prepare, convert and compare with --overwrite onto a link: the target gets the new output whole (as
    one written without a link), nothing of the old one stays, the link is kept, and nothing is left beside
    either (no .partial, .old-, .lock)."""
    src = tmp_path / "a.txt"
    docs = make_docs(25, 3, "new")
    write_corpus(src, docs)
    old = tmp_path / "old.txt"
    write_corpus(old, make_docs(10, 4, "old"))
    targets = tmp_path / "targets"
    prepare(str(old), "bytes", str(targets / "ds"), val_fraction=0.2, progress=False)
    os.symlink(targets / "ds", tmp_path / "ds_link")
    meta = prepare(str(src), "bytes", str(tmp_path / "ds_link"), val_fraction=0.2, progress=False, overwrite=True)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(docs)
    reference = tmp_path / "reference_ds"
    prepare(str(src), "bytes", str(reference), val_fraction=0.2, progress=False)
    assert json.load(open(targets / "ds" / "meta.json")) == json.load(open(reference / "meta.json"))

    shutil.copytree(TINY_HF, targets / "model")
    open(targets / "model" / "extra.txt", "w").write("of the old model")
    os.symlink(targets / "model", tmp_path / "model_link")
    convert(hf_dir=TINY_HF, out=str(tmp_path / "model_link"), dtype="bfloat16", overwrite=True)
    convert(hf_dir=TINY_HF, out=str(tmp_path / "reference_model"), dtype="bfloat16")
    assert tree_digest(targets / "model") == tree_digest(tmp_path / "reference_model")

    open(targets / "table.md", "w").write("old table")
    os.symlink(targets / "table.md", tmp_path / "table_link")
    written = check_outputs([str(reference)], {"--out": str(tmp_path / "table_link")}, True)["--out"]
    paths.write_text_atomic(written, "new table")
    assert open(targets / "table.md").read() == "new table"

    for link, target in (("ds_link", "ds"), ("model_link", "model"), ("table_link", "table.md")):
        assert os.readlink(tmp_path / link) == str(targets / target)
    leftovers = [n for folder in (tmp_path, targets) for n in os.listdir(folder)
                 if re.search(r"\.(partial|old-\d+|lock(-\d+)?|tmp\d+)$", n)]
    assert leftovers == []


def test_the_old_folder_that_cannot_be_deleted_after_the_swap_is_a_warning(tmp_path, monkeypatch):
    """Once the new folder is in place, the command has succeeded: deleting the old one failing is one
    warning naming where it was set aside, never an error."""
    out = tmp_path / "out"
    os.makedirs(out)
    open(out / "old.txt", "w").write("old")
    real_rmtree = shutil.rmtree

    def refuses_the_old(path, *args, **kwargs):
        if ".old-" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(paths.shutil, "rmtree", refuses_the_old)
    said = io.StringIO()
    with redirect_stderr(said):
        paths.write_whole(str(out), lambda folder: open(os.path.join(folder, "new.txt"), "w").write("new"),
                          overwrite=True)
    assert os.listdir(out) == ["new.txt"]
    aside = [n for n in os.listdir(tmp_path) if ".old-" in n]
    assert len(aside) == 1 and said.getvalue().startswith("warning: ") and aside[0] in said.getvalue()


def test_the_command_lines_say_it_in_one_line(world):
    """The CLI line and exit code of one refusal (the others share its path: prepare's DataError)."""
    before = snapshot(world)
    proc = subprocess.run(module_cmd("deltares.data.prepare", "--source", f"{world}/src/a.txt", "--tokenizer",
                                     "bytes", "--out", f"{world}/src", "--overwrite"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: --out {world}/src contains the input {world}/src/a.txt, which replacing it would delete; choose "
        "another --out"], describe(proc)
    assert snapshot(world) == before
