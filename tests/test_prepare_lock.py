"""One writer per prepared dataset, and a resume that notices a changed source (deltares.data.prepare,
issue 48): `<out>.lock` beside `--out` names its holder and the plan; a prepare of other input is refused
while it is held (also through another shard's lock), one of the same input waits, a stale one is taken
over with a warning; two real prepares of different sources into one `--out` never both succeed; a
finished unit whose source changed since it was read (its size, or its text with size and modification
time kept) is named and tokenized again, so the dataset is the one a fresh prepare of the changed source
gives. Expected documents are counted here from the text written (blank-line separated)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from debug_runs import describe, module_cmd
from deltares.common.lock import _process_start
from deltares.data import prepare as prepare_module
from deltares.data.dataset import TokenData
from deltares.data.documents import DataError
from deltares.data.prepare import prepare
from jax_cache import ENV, ROOT
from test_interrupts import handles_sigterm
from test_data import make_docs, write_corpus

KW = dict(val_fraction=0.2, progress=False)


def corpus(folder, tag, n_files=3, docs=30):
    """`n_files` text files (one unit each) of `docs` documents; the comma list and the documents."""
    os.makedirs(folder, exist_ok=True)
    files, everything = [], []
    for i in range(n_files):
        texts = make_docs(docs, hash((tag, i)) % 1000, f"{tag}{i}")
        write_corpus(os.path.join(folder, f"{tag}{i}.txt"), texts)
        files.append(os.path.join(folder, f"{tag}{i}.txt"))
        everything += texts
    return ",".join(files), everything


def documents(meta) -> int:
    return meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]


def tokens(out):
    data = TokenData(str(out))
    return {split: np.asarray(data.tokens(split)) for split in ("train", "val")}


def hold(lock_path, **fields):
    """A lock record of a live process (this one) on this host, as another prepare would write it."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
              "started": "2026-01-01 00:00:00", "heartbeat": time.time(), "token": "x", "command": "prepare"}
    record.update(fields)
    with open(lock_path, "w") as f:
        json.dump(record, f)


def test_a_lock_of_other_input_refuses_and_one_of_the_same_input_waits(tmp_path, capsys):
    source, _ = corpus(tmp_path / "src", "a")
    out = tmp_path / "ds"
    hold(f"{out}.lock", plan="another plan")
    with pytest.raises(DataError, match=r"ds is in use by another prepare \(process \d+ on .*, started 2026-01-01"):
        prepare(source, "bytes", str(out), **KW)
    hold(f"{out}.lock-1", plan="another plan")  # another shard's lock, of other input
    os.remove(f"{out}.lock")
    with pytest.raises(DataError, match="is being prepared from other input"):
        prepare(source, "bytes", str(out), **KW)
    assert not os.path.exists(out) and not os.path.exists(f"{out}.lock")
    os.remove(f"{out}.lock-1")

    plan = prepare_module.make_plan(source, "bytes", KW["val_fraction"])
    hold(f"{out}.lock", plan=prepare_module._digest(plan))  # the same input: wait for it
    threading.Timer(1.0, os.remove, [f"{out}.lock"]).start()
    meta = prepare(source, "bytes", str(out), **KW)
    assert "prepare: waiting for process" in capsys.readouterr().err and meta is not None
    assert not os.path.exists(f"{out}.lock")


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    source, docs = corpus(tmp_path / "src", "a")
    out = tmp_path / "ds"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    hold(f"{out}.lock", pid=dead.pid, plan="another plan")
    meta = prepare(source, "bytes", str(out), **KW)
    assert documents(meta) == len(docs)
    err = capsys.readouterr().err
    assert f"warning: took over the lock of {out} from process {dead.pid}" in err and "no longer running" in err
    assert not os.path.exists(f"{out}.lock")


def test_two_prepares_of_different_sources_into_one_out_never_both_succeed(tmp_path):
    """Real processes, each paused once its imports are done and let go together; the one that succeeds
    owns the whole dataset (its documents), the other ends in one error line. A BPE tokenizer is trained
    between the look at `--out` and the first write into it: without the lock both find it empty and
    both succeed."""
    sources = [corpus(tmp_path / name, name, n_files=2, docs=400) for name in ("a", "b")]
    out = tmp_path / "ds"
    procs = [subprocess.Popen(module_cmd("deltares.data.prepare", "--source", source, "--tokenizer", "bpe:400",
                                         "--val_fraction", "0.2", "--out", str(out)),
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for source, _ in sources]
    deadline, waiting = time.monotonic() + 120, list(procs)
    while waiting and time.monotonic() < deadline:  # each stopped as soon as its imports are done
        for proc in [p for p in waiting if handles_sigterm(p.pid) or p.poll() is not None]:
            proc.send_signal(signal.SIGSTOP)
            waiting.remove(proc)
    for proc in procs:
        proc.send_signal(signal.SIGCONT)
    done = [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]
    winners = [i for i, proc in enumerate(done) if proc.returncode == 0]
    assert len(winners) == 1, [describe(p) for p in done]
    loser = done[1 - winners[0]]
    lines = [line for line in loser.stderr.splitlines() if line.strip() and "tokenizing" not in line]
    assert loser.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), describe(loser)
    assert "Traceback" not in loser.stderr
    meta = json.load(open(out / "meta.json"))
    assert meta["source"] == sources[winners[0]][0] and documents(meta) == len(sources[winners[0]][1])
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "ds"]  # no lock left, no partial folder


def change_keeping_size_and_time(path):
    """The same number of bytes with other text (a letter of each document's first word), and the file's
    modification time put back: only the content tells."""
    stat = os.stat(path)
    text = open(path, encoding="utf-8").read()
    changed = text.replace(" doc ", " dok ")
    assert changed != text and len(changed.encode()) == len(text.encode())
    open(path, "w", encoding="utf-8").write(changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("change", ["size", "content"])
def test_a_resumed_prepare_redoes_the_units_whose_source_changed(tmp_path, monkeypatch, capsys, change):
    """Killed after two of three units; then the first unit's file changes (grows, or other text of the
    same size and time); the resume names it, tokenizes it again and gives what a fresh prepare gives."""
    source, _ = corpus(tmp_path / "src", "a")
    first = source.split(",")[0]
    out = tmp_path / "ds"
    real = prepare_module.tokenize_unit

    def dies_in_the_third(out_dir, plan, index, tokenizer_json):
        if index == 2:
            raise KeyboardInterrupt
        return real(out_dir, plan, index, tokenizer_json)

    monkeypatch.setattr(prepare_module, "tokenize_unit", dies_in_the_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(source, "bytes", str(out), **KW)
    monkeypatch.setattr(prepare_module, "tokenize_unit", real)
    if change == "size":
        with open(first, "a", encoding="utf-8") as f:
            f.write("\n\nOne more document, written after the unit was tokenized.\n")
    else:
        change_keeping_size_and_time(first)
    capsys.readouterr()
    meta = prepare(source, "bytes", str(out), **KW)
    err = capsys.readouterr().err
    assert f"warning: {first} changed since unit 0 was tokenized from it (" in err, err
    assert ("its size went from" if change == "size" else "its size and modification time did not") in err
    assert "unit 1 " not in err
    fresh = prepare(source, "bytes", str(tmp_path / "fresh"), **KW)
    assert meta == fresh
    for split, stream in tokens(out).items():
        np.testing.assert_array_equal(stream, tokens(tmp_path / "fresh")[split])


def test_a_finished_dataset_whose_source_changed_is_prepared_again(tmp_path, capsys):
    source, _ = corpus(tmp_path / "src", "a", n_files=2)
    out = tmp_path / "ds"
    prepare(source, "bytes", str(out), **KW)
    capsys.readouterr()
    assert prepare(source, "bytes", str(out), **KW) is not None
    assert "already holds this dataset; nothing to do" in capsys.readouterr().err
    second = source.split(",")[1]
    change_keeping_size_and_time(second)
    meta = prepare(source, "bytes", str(out), **KW)
    err = capsys.readouterr().err
    assert f"warning: {second} changed since unit 1 was tokenized from it" in err and "unit 0" not in err
    assert meta == prepare(source, "bytes", str(tmp_path / "fresh"), **KW)
