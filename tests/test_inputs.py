"""Naming inputs (issue 48, deltares.common.inputs): every command that reads a user's files, walked over
every way of naming them wrongly or oddly, and never a file read twice, a traceback or an input changed.

The commands: `prepare --source` (its plan and reader, `make_plan` and `unit_pieces`), `eval --data` and
`analyze --data` (both read a source with `data_units` and `source_tokens`, before any checkpoint is
loaded), `generate --prompt_file` (`read_prompts`), `config.data.mixture` (`Mixture`),
`config.data.dataset` (`open_run_dataset`) and `--config` (`config_file_error`, `resolve_config`). The
classes: a path that holds glob characters, a glob that matches nothing (alone and in a list), a file
named twice, overlapping globs, a symlink to a listed file, a symlink loop, a folder where a file is
expected (a file where a folder is), a trailing comma. What each command read is checked against the
documents written here (each a line of text, so also one prompt), and every input is hashed before and
after. The `error:` line of each command is its own `main`'s, run in this process on the parsed flags
(tests/test_faults.py runs a few through a real process; tests/faults.py runs every class that way)."""

import hashlib
import os
import stat
from typing import NamedTuple

import numpy as np
import pytest

from deltares import command_line
from deltares.common.inputs import DataError, resolve_inputs
from deltares.data.dataset import data_units, source_tokens
from deltares.data.mixture import Mixture
from deltares.data.prepare import make_plan, prepare, unit_pieces
from deltares.data.run_data import open_run_dataset
from deltares.data.tokenizer import ByteTokenizer
from deltares.generate import read_prompts
from test_domains import command_flags as _command_flags, parse

command_flags = _command_flags  # a fixture of test_domains, used here too

DOCS = {"a.txt": ["alpha one", "alpha two"], "b.txt": ["beta one"], "data[1].txt": ["bracket one", "bracket two"]}


def inputs_digest(root) -> dict:
    """{relative path: sha256 of a file, the target of a symlink, or the kind of anything else} under `root`,
    opening nothing but regular files (a named pipe would block, a symlink loop fail)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[os.path.relpath(path, root)] = "-> " + os.readlink(path)
            elif stat.S_ISREG(mode):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[os.path.relpath(path, root)] = stat.S_IFMT(mode)
    return out


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """files/ (a.txt, b.txt, data[1].txt: documents one a line, blank lines between), odd/ (a symlink to
    files/a.txt, a symlink loop, a broken symlink, a folder, a named pipe), datasets/ (ds_a, ds[1]
    prepared; a symlink to ds_a, a loop, a file), configs/ (exp[1].py, a symlink to it, a loop)."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "files").mkdir()
    for name, docs in DOCS.items():
        (root / "files" / name).write_text("\n\n".join(docs) + "\n")
    odd = root / "odd"
    odd.mkdir()
    os.symlink("../files/a.txt", odd / "link.txt")
    os.symlink("loop.txt", odd / "loop.txt")
    os.symlink("gone.txt", odd / "broken.txt")
    (odd / "sub").mkdir()
    (odd / "sub" / "c.txt").write_text("inside\n")
    os.mkfifo(odd / "pipe.txt")
    sets = root / "datasets"
    sets.mkdir()
    for name, docs in (("ds_a", [f"a document {i}" for i in range(40)]), ("ds[1]", [f"b document {i}" for i in range(40)])):
        (root / f"{name}.txt").write_text("\n\n".join(docs))
        prepare(str(root / f"{name}.txt"), "bytes", str(sets / name), val_fraction=0.2, progress=False)
    os.symlink("ds_a", sets / "ds_link")
    os.symlink("ds_loop", sets / "ds_loop")
    (sets / "plain.txt").write_text("not a dataset\n")
    configs = root / "configs"
    configs.mkdir()
    (configs / "exp[1].py").write_text("def get_config():\n    return None\n")
    os.symlink("exp[1].py", configs / "link.py")
    os.symlink("loop.py", configs / "loop.py")
    return root


# ----------------------------------------------------------------------------- the commands that read files


def by_prepare(spec):
    """The documents `prepare --source spec` would tokenize: its plan's units, read by its reader."""
    plan = make_plan(spec, "bytes", 0.25)
    docs, parts = [], []
    for index in range(len(plan["units"])):
        for piece in unit_pieces(plan, index):
            parts.append(piece.text)
            if piece.last:
                docs.append("".join(parts))
                parts = []
    return docs


def by_eval(spec):
    """The documents `eval --data spec` and `analyze --data spec` score: their tokens (bytes) cut at end-of-text."""
    tokens, _ = source_tokens(data_units(spec), ByteTokenizer())
    cuts = np.flatnonzero(tokens == ByteTokenizer.eos_id)
    assert len(cuts) and cuts[-1] == len(tokens) - 1
    return [bytes(doc[:-1].astype(np.uint8)).decode() for doc in np.split(tokens, cuts + 1)[:-1]]


FILE_COMMANDS = {"prepare --source": by_prepare, "eval/analyze --data": by_eval, "generate --prompt_file": read_prompts}


class Read(NamedTuple):
    docs: list  # the documents read, in order
    warned: bool = False  # with a warning that a file was named twice


class Error(NamedTuple):
    words: list  # what its one line says


FILE_CASES = [  # (class, spec, outcome)
    ("literal with glob characters", "files/data[1].txt", Read(DOCS["data[1].txt"])),
    ("dead glob alone", "files/nothing*.txt", Error(["files/nothing*.txt'", "matches no file"])),
    ("dead glob in a list", "files/a.txt,files/nothing*.txt", Error(["files/nothing*.txt'", "matches no file"])),
    ("duplicate", "files/a.txt,files/a.txt", Read(DOCS["a.txt"], True)),
    ("overlap", "files/*.txt,files/a*", Read(DOCS["a.txt"] + DOCS["b.txt"] + DOCS["data[1].txt"], True)),
    ("symlink to a listed file", "files/a.txt,odd/link.txt", Read(DOCS["a.txt"], True)),
    ("symlink loop", "files/a.txt,odd/loop.txt", Error(["odd/loop.txt", "symlink loop"])),
    ("broken symlink", "odd/broken.txt", Error(["odd/broken.txt", "broken symlink (to gone.txt"])),
    ("folder", "odd/sub", Error(["odd/sub", "is a folder"])),
    ("named pipe", "odd/pipe.txt", Error(["odd/pipe.txt", "is a named pipe"])),
    ("trailing comma", "files/a.txt,", Error(["'files/a.txt,'", "entry 2 of 2 is empty", "trailing comma"])),
    ("doubled comma", "files/a.txt,,files/b.txt", Error(["entry 2 of 3 is empty", "doubled comma"])),
]


@pytest.mark.parametrize("command", FILE_COMMANDS)
def test_every_way_of_naming_files_reads_each_once_or_is_one_error(tree, command, monkeypatch, capsys):
    monkeypatch.chdir(tree)  # relative paths; absolute ones and ~: the next test
    before = inputs_digest(tree)
    for name, spec, outcome in FILE_CASES:
        if name == "named pipe" and command == "generate --prompt_file":
            continue  # read once, so taken: the test below
        capsys.readouterr()
        if isinstance(outcome, Error):
            with pytest.raises(DataError) as err:
                FILE_COMMANDS[command](spec)
            message = str(err.value)
            assert "\n" not in message and all(w in message for w in outcome.words), (command, name, message)
        else:
            assert FILE_COMMANDS[command](spec) == outcome.docs, (command, name)
            warning = capsys.readouterr().err
            assert ("; it is read once" in warning) == outcome.warned, (command, name, warning)
    assert inputs_digest(tree) == before


def test_prompts_are_read_from_a_named_pipe_once(tmp_path):
    """What a command reads once (prompts) may come from a named pipe, as `--prompt_file <(...)` gives it;
    what is read more than once (a source) may not: the walk above."""
    import threading

    pipe = tmp_path / "prompts"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(b"\xef\xbb\xbfCall me Ishmael.\r\nThe whale\n"))
    writer.start()
    assert read_prompts(str(pipe)) == ["Call me Ishmael.", "The whale"]
    writer.join()


@pytest.mark.parametrize("style", ["absolute", "home", "relative"])
def test_absolute_relative_and_home_paths_name_the_same_files(tree, style, monkeypatch):
    monkeypatch.setenv("HOME", str(tree))
    monkeypatch.chdir(tree / "odd")
    prefix = {"absolute": f"{tree}/files/", "home": "~/files/", "relative": "../files/"}[style]
    spec = f"{prefix}data[1].txt,{prefix}b*.txt"
    want = DOCS["data[1].txt"] + DOCS["b.txt"]
    for command, read in FILE_COMMANDS.items():
        assert read(spec) == want, (command, style)
    assert resolve_inputs(spec) == [str(tree / "files" / "data[1].txt"), str(tree / "files" / "b.txt")]


def test_a_spec_that_names_a_file_with_a_comma_is_that_file(tmp_path):
    (tmp_path / "a,b.txt").write_text("comma one\n\ncomma two\n")
    for command, read in FILE_COMMANDS.items():
        assert read(str(tmp_path / "a,b.txt")) == ["comma one", "comma two"], command


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_is_one_error(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("x\n")
    path.chmod(0)
    for command, read in FILE_COMMANDS.items():
        with pytest.raises(DataError, match="secret.txt cannot be read: Permission denied"):
            read(str(path))


# ----------------------------------------------------------------------------- folders: mixtures, data.dataset


def by_mixture(spec):
    return [os.path.basename(data.path) for data, _ in Mixture(spec).sources]


def by_dataset(spec):
    config = {"data": {"mixture": "", "dataset": spec, "tokenizer": "bytes"}, "model": {"vocab_size": 300}}
    return [os.path.basename(open_run_dataset(config, "unused").path)]


FOLDER_CASES = {  # class: (mixture spec, its outcome), (data.dataset spec, its outcome)
    "literal with glob characters": (("ds[1]=1,ds_a=1", ["ds[1]", "ds_a"]), ("ds[1]", ["ds[1]"])),
    "dead glob alone": (("nothing*=1,ds_a=1", ["nothing*", "no such folder"]), ("nothing*", ["nothing*", "no such folder"])),
    "dead glob in a list": (("ds_a=1,nothing*=1", ["nothing*", "no such folder"]),
                            ("ds_a,nothing*", ["ds_a,nothing*", "no such folder"])),
    "duplicate": (("ds_a=1,ds_a=1", ["ds_a twice", "name each once"]), ("ds_a,ds_a", ["no such folder"])),
    "overlap": (("ds*=1,ds_a=1", ["ds*", "no such folder"]), ("ds*", ["ds*", "no such folder"])),
    "symlink to a listed folder": (("ds_a=1,ds_link=1", ["as ds_a and as ds_link", "name each once"]),
                                   ("ds_link", ["ds_a"])),
    "symlink loop": (("ds_loop=1,ds_a=1", ["ds_loop", "symlink loop"]), ("ds_loop", ["ds_loop", "symlink loop"])),
    "file where a folder is expected": (("plain.txt=1,ds_a=1", ["plain.txt is a file, not a folder"]),
                                        ("plain.txt", ["plain.txt is a file, not a folder"])),
    "trailing comma": (("ds_a=1,ds[1]=1,", ["entry 3 of 3 is empty"]), ("ds_a,", ["ds_a,: no such folder"])),
}


def test_every_way_of_naming_datasets_is_the_datasets_or_one_error(tree, monkeypatch):
    monkeypatch.chdir(tree / "datasets")
    before = inputs_digest(tree)
    for name, cases in FOLDER_CASES.items():
        for read, (spec, want) in zip((by_mixture, by_dataset), cases):
            if name in ("literal with glob characters",) or (read is by_dataset and name.startswith("symlink to")):
                assert read(spec) == want, (name, spec)
                continue
            with pytest.raises(DataError) as err:
                read(spec)
            assert "\n" not in str(err.value) and all(w in str(err.value) for w in want), (name, spec, err.value)
    assert inputs_digest(tree) == before


# ----------------------------------------------------------------------------- --config


def test_every_way_of_naming_an_experiment_file(tree, monkeypatch):
    monkeypatch.chdir(tree / "configs")
    monkeypatch.setenv("HOME", str(tree))
    ok = {"exp[1].py": "exp[1].py", "link.py": "link.py", "~/configs/exp[1].py": f"{tree}/configs/exp[1].py"}
    for given, resolved in ok.items():
        assert command_line.resolve_config(given + ":x") == resolved + ":x"
        assert command_line.config_file_error(resolved) is None, given
    bad = {"nothing*.py": "nothing*.py: no such file", "exp[1].py,nothing*.py": "exp[1].py,nothing*.py: no such",
           "loop.py": "loop.py is a symlink loop", ".": ". is a folder, not a file",
           "exp[1].py,": "exp[1].py,: no such file"}
    for given, words in bad.items():
        line = command_line.config_file_error(command_line.resolve_config(given).partition(":")[0])
        assert line == f"--config {words}" or (line.startswith(f"--config {words}")), (given, line)


def test_an_experiment_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.py"
    path.write_bytes(b"\xef\xbb\xbfdef get_config():\n    return None\n")
    assert command_line.config_file_error(str(path)) is None


# ----------------------------------------------------------------------------- each command's error line


ERROR_CASES = [case for case in FILE_CASES if isinstance(case[2], Error)]
TOOLS = {  # module: the command line without the input, the flag that names it
    "deltares.data.prepare": (["--tokenizer", "bytes", "--out", "OUT"], "--source"),
    "deltares.eval": (["--checkpoint", "no_checkpoint"], "--data"),
    "deltares.analyze": (["--checkpoint", "no_checkpoint"], "--data"),
    "deltares.generate": (["--checkpoint", "no_checkpoint"], "--prompt_file"),
}


@pytest.mark.parametrize("module", TOOLS)
def test_each_command_names_the_input_in_one_error_line(tree, module, command_flags, monkeypatch, tmp_path):
    """The tool's own `main`, on its parsed flags: the input is checked before a checkpoint is loaded or
    anything written."""
    monkeypatch.chdir(tree)
    command_flags(module)
    main = __import__(module, fromlist=["main"]).main
    args, flag = TOOLS[module]
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    before = inputs_digest(tree)
    for name, spec, (words,) in ERROR_CASES:
        if name == "named pipe" and module == "deltares.generate":
            continue  # read once, so taken
        assert parse([module, *args, flag, spec]) is None
        with pytest.raises(SystemExit) as exit:
            main([module])
        line = str(exit.value.code)
        assert line.startswith(f"error: {flag} ") and "\n" not in line and all(w in line for w in words), (name, line)
    assert inputs_digest(tree) == before and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- buckets, and scripts


def test_bucket_entries_are_named_the_same_way(fake_bucket, tmp_path, capsys):
    folder = tmp_path / "bucket" / "corpus"
    folder.mkdir()
    for name, docs in DOCS.items():
        (folder / name).write_text("\n\n".join(docs) + "\n")
    found = resolve_inputs("gs://corpus/*.txt,gs://corpus/a.txt", flag="--source")
    assert [p.rsplit("/", 1)[1] for p in found] == ["a.txt", "b.txt", "data[1].txt"]
    assert all(p.startswith("gs://") for p in found) and "it is read once" in capsys.readouterr().err
    assert by_prepare("gs://corpus/data[1].txt") == DOCS["data[1].txt"]  # a name with glob characters
    for spec, words in (("gs://corpus/nothing*.txt", "matches no file"), ("gs://corpus/a.txt,", "trailing comma"),
                        ("gs://corpus/gone.txt", "no such file"), ("gs://corpus", "is a folder, not a file")):
        with pytest.raises(DataError, match=words):
            resolve_inputs(spec, flag="--source")


def test_scripts_check_a_spec_as_the_tools_do(tree, monkeypatch, capsys):
    from deltares.common import inputs

    monkeypatch.chdir(tree)
    assert inputs.main(["--flag=--source", "files/*.txt,files/a.txt"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(tree / "files" / n) for n in ("a.txt", "b.txt", "data[1].txt")] and "read once" in err
    assert inputs.main(["--flag=--config", "--one", "configs/loop.py"]) == 1
    assert capsys.readouterr().err == "error: --config configs/loop.py is a symlink loop\n"
    assert inputs.main(["--want", "folder", "datasets/ds_link"]) == 0
    assert capsys.readouterr().out.strip() == str(tree / "datasets" / "ds_a")
