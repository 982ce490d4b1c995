"""The trainer end to end (`deltares.train`, `deltares.eval`, `deltares.data.prepare` CLIs) on the `debug`
experiment: learning, logging, determinism, exact resume after SIGKILL / SIGTERM, the
prepare -> train -> eval round trip, and clean one-line errors for bad input.

Every run uses `train.steps=30` (the debug default) and the same model, so the train step
compiles once; compiled executables are also cached on disk (`DELTARES_TEST_JAX_CACHE`,
default `$TMPDIR/deltares-test-jax-cache`) for the subprocesses and later runs.
"""

import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from deltares.training.checkpoint import load_checkpoint
from deltares.data.documents import DataError
from deltares.data.prepare import prepare
from deltares.train import TrainError, train

from debug_runs import (
    BATCH, RESUME_OVERRIDES, SEQ, STEPS, assert_clean_error, assert_nothing_to_resume, checkpoint_steps,
    config_with, debug_config, describe, module_cmd, read_metrics, run, tensorboard_scalars, train_cmd,
    tree_digest, write_paragraphs,
)
from jax_cache import ENV, ROOT
from test_data import held

REQUIRED_KEYS = {"step", "loss", "loss_mean", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "tokens_seen"}
EVAL_KEYS = {"val_loss", "val_ppl", "val_bpb"}
STATS_KEYS = {"routing_max_weight", "routing_entropy"}


# ----------------------------------------------------------------------------- 1. learning and logging


def test_debug_run_on_builtin_corpus_learns_and_logs(tmp_path):
    cfg = debug_config()
    assert cfg.data.dataset == "builtin" and cfg.train.steps == STEPS
    result = train(cfg, str(tmp_path))

    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]  # log_every=5
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-5:]) < losses[0], losses
    assert losses[-1] < losses[0] - 0.5, losses  # well below where it started (~ln 257 = 5.55)
    for r in records:
        assert REQUIRED_KEYS <= r.keys(), r.keys()
        assert all(math.isfinite(r[k]) for k in REQUIRED_KEYS), r
        assert r["tokens_seen"] == r["step"] * BATCH * SEQ
        assert cfg.optim.lr_min * 0.999 <= r["lr"] <= cfg.optim.lr * 1.001
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] > 0
        is_eval = is_stats = r["step"] % 10 == 0  # eval_every = stats_every = 10
        assert (EVAL_KEYS <= r.keys()) == is_eval and (STATS_KEYS <= r.keys()) == is_stats, r.keys()
        if is_eval:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-6)
            # bytes tokenizer: one token per byte (end-of-text counted as one byte), so bits/byte = loss / ln 2
            assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-6)
        if is_stats:
            for key in STATS_KEYS:
                assert len(r[key]) == 2 * 3  # one entry per sublayer
            assert all(0.0 <= w <= 1.0 for w in r["routing_max_weight"])
    # The logged lr is the one the step's update used: schedule(step - 1). Step 5 is still in
    # the 5-step warmup (4/5 of the peak); from step 10 on the cosine decays.
    lrs = [r["lr"] for r in records]
    assert lrs[0] == pytest.approx(cfg.optim.lr * 4 / 5, rel=1e-5), lrs
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])), f"LR must decay after the 5 warmup steps: {lrs}"

    assert checkpoint_steps(str(tmp_path)) == [10, 20, 30]
    assert os.path.exists(tmp_path / "dataset" / "meta.json")  # the built-in corpus, prepared into the workdir
    scalars = tensorboard_scalars(str(tmp_path))
    assert scalars[("loss", 30)] == pytest.approx(records[-1]["loss"], rel=1e-6)
    assert scalars[("val_loss", 20)] == pytest.approx(records[3]["val_loss"], rel=1e-6)
    assert ("routing_entropy/005", 30) in scalars

    assert result["step"] == STEPS
    assert math.isfinite(result["val_ppl"]) and result["val_ppl"] == pytest.approx(records[-1]["val_ppl"])
    assert result["val_ppl"] < 257  # better than uniform over the byte vocabulary
    assert math.isfinite(result["unigram_ppl"]) and 1 < result["unigram_ppl"] < 257


@pytest.mark.parametrize("mode", ["hyper", "mhc", "denseformer"])
def test_the_mixing_modes_train_and_log_their_weights(mode, builtin_dataset, tmp_path):
    """A few steps of each mixing mode on the debug config lower the loss, and its weights by depth are
    logged as the routing modes' are (hyper, mhc: the 4 streams' read weights; denseformer: the 4 layer
    outputs' average weights, on each layer's last sublayer)."""
    cfg = debug_config(mode)
    cfg.data.dataset = str(builtin_dataset)
    cfg.train.update(steps=12, log_every=3, eval_every=12, stats_every=12, checkpoint_every=12)
    result = train(cfg, str(tmp_path))
    records = read_metrics(str(tmp_path))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3, losses
    stats = records[-1]
    assert len(stats["routing_entropy"]) == 6 and math.isfinite(result["val_ppl"])
    entropies = np.asarray(stats["routing_entropy"])
    if mode == "denseformer":  # only the layers' last sublayers average
        assert (entropies[0::2] == 0).all() and (entropies[1::2] > 0).all(), entropies
    else:
        assert (entropies > 0).all(), entropies


def test_logged_throughput_is_the_rate_around_the_loop(builtin_dataset, tmp_path):
    """`tokens_per_s` (and so `step_time_s` and `mfu`) is timed when the window's steps have run, not
    when they were dispatched: within 1.5x of the rate between two records' writes (it was 400x off)."""
    from throughput import measure

    cfg = config_with(builtin_dataset, global_batch=16, steps=41, log_every=10, eval_every=41, checkpoint_every=41,
                      stats_every=0)
    rows = measure(cfg, str(tmp_path))
    assert [r["step"] for r in rows] == [20, 30, 40], rows  # the windows after step 10, 20, 30 (none before the first)
    for r in rows:
        assert 0.5 <= r["ratio"] <= 1.5, rows  # the clocks differ by a record's logging (and a loaded machine)
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    for r in rows:
        rec = records[r["step"]]
        assert rec["step_time_s"] == pytest.approx(16 * SEQ / rec["tokens_per_s"])


# ----------------------------------------------------------------------------- 2. determinism


def test_same_config_gives_identical_losses(reference, builtin_dataset, tmp_path):
    train(config_with(builtin_dataset, **RESUME_OVERRIDES), str(tmp_path / "again"))
    again = read_metrics(str(tmp_path / "again"))
    assert {r["step"]: r["loss"] for r in again} == reference["loss"]
    assert len(set(reference["loss"].values())) == STEPS  # 30 distinct values: the comparison is not vacuous
    want = read_metrics(reference["workdir"])
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in want]


# ----------------------------------------------------------------------------- 3. exact resume


def resume_cmd(workdir, dataset):
    return train_cmd(workdir, f"--config.data.dataset={dataset}",
                     *(f"--config.train.{k}={v}" for k, v in RESUME_OVERRIDES.items()))


def start_and_wait_for_checkpoint(cmd, workdir, min_step=8, timeout=150):
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = checkpoint_steps(workdir)
        if steps and steps[-1] >= min_step:
            return proc, steps[-1]
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training exited (rc={proc.returncode}) before a checkpoint >= {min_step}:\n{out}\n{err}")
        time.sleep(0.005)
    proc.kill()
    proc.communicate()
    pytest.fail(f"no checkpoint >= {min_step} within {timeout} s")


def assert_resumed_like_reference(workdir, reference, proc, interrupted_at):
    assert proc.returncode == 0, describe(proc)
    match = re.search(r"resumed .* from step (\d+)", proc.stderr)
    assert match, describe(proc)
    start = int(match.group(1))
    assert 8 <= start <= min(interrupted_at, STEPS), (start, interrupted_at)
    records = read_metrics(workdir)
    # records written after the restored checkpoint by the interrupted run were dropped, then rewritten once
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert abs(r["loss"] - reference["loss"][r["step"]]) <= 1e-6, (r["step"], r["loss"], reference["loss"][r["step"]])
    # the final state is the reference's, parameter for parameter
    got, want = load_checkpoint(workdir), load_checkpoint(reference["workdir"])
    assert got.step == want.step == STEPS
    for a, b in zip(jax.tree.leaves(got.state["params"]), jax.tree.leaves(want.state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    return start


def test_resume_after_sigkill_matches_uninterrupted_run(reference, builtin_dataset, tmp_path):
    """Also the lock: a second trainer on the running one's workdir refuses, naming it (and changing
    nothing); the killed run's lock is taken over by the rerun with a warning."""
    workdir = str(tmp_path / "run")
    cmd = resume_cmd(workdir, builtin_dataset)
    proc, seen = start_and_wait_for_checkpoint(cmd, workdir)
    with pytest.raises(TrainError, match=rf"{workdir} is in use by another trainer \(process {proc.pid} on "):
        train(config_with(builtin_dataset, **RESUME_OVERRIDES), workdir)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = max(r["step"] for r in read_metrics(workdir))
    assert killed_at >= seen
    assert json.loads(open(os.path.join(workdir, "LOCK")).read())["pid"] == proc.pid  # left by the killed run

    rerun = run(cmd)
    assert f"warning: took over the lock of {workdir} from process {proc.pid}" in rerun.stderr, describe(rerun)
    start = assert_resumed_like_reference(workdir, reference, rerun, max(killed_at, seen))
    assert start >= seen
    assert not os.path.exists(os.path.join(workdir, "LOCK"))


def test_resume_after_sigterm_matches_uninterrupted_run(reference, builtin_dataset, tmp_path):
    workdir = str(tmp_path / "run")
    cmd = resume_cmd(workdir, builtin_dataset)
    proc, seen = start_and_wait_for_checkpoint(cmd, workdir)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{err}"
    match = re.search(r"SIGTERM: saved step (\d+)", out)
    assert match, f"no 'saved step' line (did the run finish before the signal?):\n{out}\n{err}"
    saved = int(match.group(1))
    assert seen <= saved < STEPS
    assert max(r["step"] for r in read_metrics(workdir)) == saved
    # That the checkpoint of step `saved` itself exists is checked deterministically by
    # test_sigterm_during_a_logged_step_saves_that_step (a race in train.py can skip it).
    latest = checkpoint_steps(workdir)[-1]
    assert seen <= latest <= saved
    assert not os.path.exists(os.path.join(workdir, "LOCK"))  # released by the run that stopped

    rerun = run(cmd)
    assert "lock" not in rerun.stderr
    assert assert_resumed_like_reference(workdir, reference, rerun, saved) == latest


def test_sigterm_during_a_logged_step_saves_that_step(builtin_dataset, tmp_path, monkeypatch, capsys):
    """SIGTERM delivered while step 10 is being evaluated (eval_every=10; checkpoint_every=4): the step the
    run reports as saved must have a checkpoint."""
    import deltares.train as train_module

    evaluate = train_module.evaluate

    def evaluate_then_sigterm(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by train's StopRequest in this (main) thread
        return out

    monkeypatch.setattr(train_module, "evaluate", evaluate_then_sigterm)
    workdir = str(tmp_path / "run")
    result = train(config_with(builtin_dataset, **RESUME_OVERRIDES), workdir)
    assert result["stopped"] == "SIGTERM" and result["step"] in (10, 11)
    saved = int(re.search(r"SIGTERM: saved step (\d+)", capsys.readouterr().out).group(1))
    assert saved == result["step"]
    assert checkpoint_steps(workdir)[-1] == saved, f"reported step {saved} saved, newest checkpoint {checkpoint_steps(workdir)}"


# ----------------------------------------------------------------------------- 4. prepare -> train -> eval


def test_prepare_train_eval_round_trip(tmp_path):
    corpus = tmp_path / "corpus.txt"
    paragraphs = write_paragraphs(corpus, 80, seed=0)
    assert 8_000 < corpus.stat().st_size < 20_000
    data = tmp_path / "data"
    p = run(module_cmd("deltares.data.prepare", "--source", str(corpus), "--tokenizer", "bytes", "--out", str(data),
                       "--val_fraction", "0.1"))
    assert p.returncode == 0, describe(p)
    meta = json.loads((data / "meta.json").read_text())
    n_val = sum(held(p, 0.1) for p in paragraphs)  # documents held out by the hash of their text
    assert meta["splits"]["val"]["documents"] == n_val >= 1 and meta["splits"]["train"]["documents"] == 80 - n_val

    workdir = tmp_path / "run"
    t = run(train_cmd(workdir, f"--config.data.dataset={data}"))
    assert t.returncode == 0, describe(t)
    m = re.search(r"step 30: validation loss ([\d.]+), perplexity ([\d.]+)", t.stdout)
    assert m, describe(t)
    final = read_metrics(str(workdir))[-1]
    assert final["step"] == 30 and final["val_loss"] == pytest.approx(float(m.group(1)), abs=1e-4)

    line = re.compile(r"step (\d+): loss ([\d.]+)  perplexity ([\d.]+)  bits/byte ([\d.]+)")
    # the trainer's own validation set (batches of 4, at most 2) must give the trainer's validation loss
    e = run(module_cmd("deltares.eval", "--checkpoint", str(workdir), "--data", str(data), "--batch", "4",
                       "--max_batches", "2"))
    assert e.returncode == 0, describe(e)
    step, loss, ppl, bpb = line.search(e.stdout).groups()
    assert int(step) == 30
    assert float(loss) == pytest.approx(final["val_loss"], abs=1e-4)
    assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-3)
    assert float(bpb) == pytest.approx(float(loss) / math.log(2), rel=1e-3)

    # a plain text file, tokenized with the run's tokenizer, and a single step directory as --checkpoint
    text = tmp_path / "other.txt"
    write_paragraphs(text, 6, seed=1)
    e = run(module_cmd("deltares.eval", "--checkpoint", str(workdir / "checkpoints" / "20"), "--data", str(text)))
    assert e.returncode == 0, describe(e)
    step, loss, ppl, bpb = line.search(e.stdout).groups()
    assert int(step) == 20
    assert math.isfinite(float(ppl)) and 1 < float(ppl) < 257
    assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-3)

    from deltares.eval import evaluate_checkpoint  # (the CLI prints such errors as one line, like train's)

    with pytest.raises(DataError, match="missing.txt"):
        evaluate_checkpoint(str(workdir), str(tmp_path / "missing.txt"))


# ----------------------------------------------------------------------------- 5. bad input


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    write_paragraphs(d / "corpus.txt", 60, seed=2)
    return d / "corpus.txt"


def test_missing_dataset_dir(tmp_path):
    workdir = tmp_path / "run"
    proc = run(train_cmd(workdir, "--config.data.dataset=/nonexistent/dataset"))
    assert_clean_error(proc, "/nonexistent/dataset", "prepare")
    assert_nothing_to_resume(str(workdir))


def test_empty_corpus_to_prepare(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    proc = run(module_cmd("deltares.data.prepare", "--source", str(tmp_path / "empty.txt"), "--tokenizer", "bytes",
                          "--out", str(tmp_path / "out")))
    assert_clean_error(proc, "empty.txt", "documents")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_empty_data_file(tmp_path, small_corpus):
    data = tmp_path / "data"
    prepare(str(small_corpus), "bytes", str(data), val_fraction=0.1, progress=False)
    (data / "train" / "00000.bin").write_bytes(b"")
    workdir = tmp_path / "run"
    with pytest.raises(DataError, match="train/00000.bin is missing or empty"):
        train(config_with(data), str(workdir))
    assert_nothing_to_resume(str(workdir))


def test_tokenizer_vocab_larger_than_model(tmp_path, small_corpus):
    data = tmp_path / "gpt2data"
    prepare(str(small_corpus), "gpt2", str(data), val_fraction=0.1, progress=False)
    workdir = tmp_path / "run"
    assert_clean_error(run(train_cmd(workdir, f"--config.data.dataset={data}")), "50257", "vocab_size=257")
    assert_nothing_to_resume(str(workdir))


def test_corpus_too_small_for_one_batch(tmp_path, builtin_dataset, small_corpus):
    workdir = tmp_path / "run"
    cfg = config_with(builtin_dataset)
    cfg.data.seq_len = 400_000  # 1.16M training tokens: 2 windows, fewer than the batch of 4
    with pytest.raises(DataError, match="fewer than one batch of 4"):
        train(cfg, str(workdir))
    assert_nothing_to_resume(str(workdir))

    # a validation split too small for one evaluation batch: one short held-out document
    corpus = tmp_path / "c.txt"
    kept = [p for p in small_corpus.read_text().split("\n\n") if p.strip() and not held(p.strip(), 0.01)]
    short = next(f"short paragraph {i}" for i in range(10_000) if held(f"short paragraph {i}", 0.01))
    corpus.write_text("\n\n".join(kept + [short]) + "\n")
    data = tmp_path / "data"
    prepare(str(corpus), "bytes", str(data), val_fraction=0.01, progress=False)
    with pytest.raises(DataError, match="fewer than one evaluation batch"):
        train(config_with(data), str(workdir))
    assert_nothing_to_resume(str(workdir))

    # nothing left behind breaks a correct run in the same workdir
    result = train(config_with(builtin_dataset, steps=STEPS), str(workdir))
    assert result["step"] == STEPS


@pytest.fixture
def finished_copy(reference, tmp_path):
    """A copy of the finished reference workdir and the digest of its checkpoints and metrics."""
    workdir = tmp_path / "copy"
    shutil.copytree(reference["workdir"], workdir)
    return str(workdir), tree_digest(workdir)


def test_incompatible_checkpoint_refused_cli(finished_copy, builtin_dataset):
    workdir, digest = finished_copy
    proc = run(train_cmd(workdir, f"--config.data.dataset={builtin_dataset}", "--config.seed=1"))
    assert_clean_error(proc, "seed", "force")
    assert tree_digest(workdir) == digest


@pytest.mark.parametrize(
    "field,value,name",
    [
        ("data.seq_len", 16, "data.seq_len"),
        ("train.global_batch", 8, "train.global_batch"),
        ("model.d_model", 64, "model"),
        ("model.residual.mode", "baseline", "model"),
    ],
)
def test_incompatible_checkpoint_refused(finished_copy, builtin_dataset, field, value, name):
    workdir, digest = finished_copy
    cfg = config_with(builtin_dataset)
    section, key = field.rsplit(".", 1)
    node = cfg
    for part in section.split("."):
        node = node[part]
    node[key] = value
    with pytest.raises(TrainError, match=re.escape(name)) as err:
        train(cfg, workdir)
    assert "force" in str(err.value)
    assert tree_digest(workdir) == digest


def test_incompatible_dataset_path_refused(finished_copy, builtin_dataset, tmp_path):
    workdir, digest = finished_copy
    other = tmp_path / "other_dataset"
    shutil.copytree(builtin_dataset, other)
    with pytest.raises(TrainError, match="data.dataset"):
        train(config_with(other), workdir)
    assert tree_digest(workdir) == digest


# ----------------------------------------------------------------------------- a run's own data


def run_config(tokenizer="bytes", **top):
    cfg = config_with("builtin").to_dict()
    cfg["data"]["tokenizer"] = tokenizer
    cfg["model"]["vocab_size"] = 320  # the tiny Qwen3 tokenizer's
    cfg.update(top)
    return cfg


@pytest.fixture(scope="module")
def own_data(builtin_dataset, small_corpus, tmp_path_factory):
    """Run directories whose `dataset/` was prepared otherwise than a config asks: {case: (workdir, the
    config that asks otherwise, what the refusal must name)}; a tokenizer `hf:TOK` (the tiny Qwen3 fixture's)."""
    from deltares.data.prepare import make_plan

    root = tmp_path_factory.mktemp("own_data")
    tok = root / "tok"
    tok.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "qwen3_tiny", "tokenizer.json"), tok)
    cases = {}

    def run_dir(name, make):
        workdir = root / name
        workdir.mkdir()
        make(str(workdir / "dataset"))
        return str(workdir)

    cases["another tokenizer"] = (run_dir("bytes", lambda out: shutil.copytree(builtin_dataset, out)),
                                  run_config("gpt2"), "tokenizer 'bytes' where config.data.tokenizer asks for 'gpt2'")
    cases["another source"] = (run_dir("text", lambda out: prepare(str(small_corpus), "bytes", out, progress=False)),
                               run_config(), "source '")
    cases["another val_fraction"] = (
        run_dir("val", lambda out: prepare("builtin", "bytes", out, val_fraction=0.1, progress=False)), run_config(),
        "val_fraction 0.1 where the built-in corpus of a run has 0.05")

    def planned(out):  # a prepare of the built-in corpus with gpt2, killed before its first unit was done
        os.makedirs(out)
        with open(os.path.join(out, "plan.json"), "w") as f:
            json.dump(make_plan("builtin", "gpt2", 0.05), f)

    cases["a prepare of another tokenizer, unfinished"] = (run_dir("planned", planned), run_config(),
                                                          "tokenizer 'gpt2' where config.data.tokenizer asks for 'bytes'")
    hf_run = run_dir("hf", lambda out: prepare("builtin", f"hf:{tok}", out, val_fraction=0.05, progress=False))
    cases["a tokenizer that changed at its path"] = (hf_run, run_config(f"hf:{tok}"), f"another tokenizer than the "
                                                     f"one at {tok} now")
    cases["init_from_hf on data of another tokenizer"] = (
        str(root / "fresh"), dict(run_config("init_from_hf", init_from_hf=str(tok)), data=dict(
            run_config()["data"], dataset=str(builtin_dataset), tokenizer="init_from_hf")),
        "tokenized with bytes, not with the tokenizer of config.init_from_hf")
    return cases, tok, hf_run


OWN_DATA = ["another tokenizer", "another source", "another val_fraction", "a prepare of another tokenizer, unfinished",
            "a tokenizer that changed at its path", "init_from_hf on data of another tokenizer"]


@pytest.mark.parametrize("case", OWN_DATA)
def test_a_run_directory_holding_data_other_than_the_config_asks_is_refused(own_data, case):
    """The built-in corpus a run prepares into its `dataset/` is checked against the config before training:
    another tokenizer (spec, or the same hf: path whose tokenizer.json changed), another source or split,
    a prepare of other input left unfinished; and data for a model of config.init_from_hf must be of its
    tokenizer. Each is one line naming what differs, and nothing in the run directory changes. The same
    config opens its data as it is (the first case with its own tokenizer, the hf: one unchanged)."""
    from deltares.data.run_data import open_run_dataset

    cases, tok, hf_run = own_data
    workdir, config, said = cases[case]
    before = tree_digest(workdir) if os.path.exists(workdir) else None
    if case == "a tokenizer that changed at its path":
        assert open_run_dataset(config, hf_run).vocab_size == 320  # unchanged: used
        text = (tok / "tokenizer.json").read_text()
        changed = json.loads(text)
        changed["model"]["merges"].pop()  # the same vocabulary, one merge less
        (tok / "tokenizer.json").write_text(json.dumps(changed))
    try:
        with pytest.raises(DataError) as err:
            open_run_dataset(config, workdir)
    finally:
        if case == "a tokenizer that changed at its path":
            (tok / "tokenizer.json").write_text(text)
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert (tree_digest(workdir) if os.path.exists(workdir) else None) == before
    if case == "another tokenizer":
        assert open_run_dataset(run_config("bytes"), workdir).vocab_size == 257  # its own config: used


def test_force_resumes_a_restorable_checkpoint(finished_copy, builtin_dataset, capsys):
    """Into another mode whose parameters have the same names and shapes (delta_block -> delta): the
    warning names every field that differs and says what is loaded."""
    workdir, digest = finished_copy
    cfg = config_with(builtin_dataset)
    cfg.seed, cfg.force, cfg.model.residual.mode = 1, True, "delta"
    result = train(cfg, workdir)
    assert result["step"] == STEPS and math.isfinite(result["val_loss"])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "despite config differences" in line]
    assert "config.model.residual.mode 'delta_block' -> 'delta'" in line and "config.seed 0 -> 1" in line, line
    assert "parameters and optimizer state are loaded into this config's model as they are" in line
    assert checkpoint_steps(workdir) == [24, 28, 30]


def test_resume_names_every_changed_setting(finished_copy, builtin_dataset, capsys):
    """Settings that keep it the same run (learning rate, weight decay, warm-up, document masks, the
    length) may change on resume, and each is said; the same config resumes without a word."""
    workdir, _ = finished_copy
    cfg = config_with(builtin_dataset, **RESUME_OVERRIDES)
    train(cfg, workdir)
    assert "warning" not in capsys.readouterr().err
    cfg.optim.update(lr=1e-3, weight_decay=0.05, warmup_steps=3)
    cfg.data.document_mask = True
    cfg.train.steps = STEPS + 2
    train(cfg, workdir)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "settings other than its checkpoint's" in lines[0], lines
    for said in ("config.optim.lr 0.003 -> 0.001", "config.optim.weight_decay 0.1 -> 0.05",
                 "config.optim.warmup_steps 5 -> 3", "config.data.document_mask False -> True",
                 f"config.train.steps {STEPS} -> {STEPS + 2}"):
        assert said in lines[0], lines[0]


def test_force_with_unrestorable_checkpoint_is_a_clean_error(finished_copy, builtin_dataset):
    """Forced into a mode with fewer parameters (baseline): one line that names the parameter, says the
    checkpoint is of another config (not damaged: nothing is to be moved aside) and how to start from it."""
    workdir, digest = finished_copy
    proc = run(train_cmd(workdir, f"--config.data.dataset={builtin_dataset}", "--config.model.residual.mode=baseline",
                         "--config.force=True"))
    assert tree_digest(workdir) == digest  # checked first: this part holds today
    assert "Traceback" not in proc.stderr, proc.stderr.strip().splitlines()[-1]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), describe(proc)
    assert "router" in lines[0] and "checkpoint has" in lines[0] and "config has none" in lines[0], lines[0]
    assert f"new --workdir with --config.init_from={workdir}" in lines[0], lines[0]
    assert not any(word in lines[0] for word in ("move", "aside", "damaged")), lines[0]


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, builtin_dataset):
    workdir = tmp_path / "run"
    proc = run(train_cmd(workdir, f"--config.data.dataset={builtin_dataset}", "--config.optim.lr=1e30",
                         "--config.optim.warmup_steps=1", "--config.train.log_every=1",
                         "--config.train.checkpoint_every=1"))
    line = assert_clean_error(proc, "non-finite loss")
    bad_step = int(re.search(r"at step (\d+)", line).group(1))
    good = int(re.search(r"last good checkpoint is step (\d+)", line).group(1))
    assert good == bad_step - 1 >= 1  # checkpoint_every=1: every step before the bad one was saved
    assert checkpoint_steps(str(workdir))[-1] == good
    records = read_metrics(str(workdir))
    assert records[-1]["step"] == good and all(math.isfinite(r["loss"]) for r in records)
    ckpt = load_checkpoint(str(workdir))
    assert ckpt.step == good
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(ckpt.state["params"]))


def test_failed_save_keeps_previous_checkpoint_usable(builtin_dataset, tmp_path, monkeypatch):
    """A storage failure while saving step 20 stops the run with a clear error; step 10 stays restorable."""
    import orbax.checkpoint as ocp

    real_save = ocp.CheckpointManager.save

    def failing_save(self, step, *args, **kwargs):
        if step == 20:
            raise OSError("No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    workdir = str(tmp_path / "run")
    cfg = config_with(builtin_dataset, steps=30, checkpoint_every=10, log_every=5)
    with pytest.raises(TrainError, match=r"saving step 20 failed .*No space left.*step 10"):
        train(cfg, workdir)
    assert checkpoint_steps(workdir) == [10]
    restored = load_checkpoint(workdir)
    assert restored.step == 10 and all(np.isfinite(x).all() for x in jax.tree.leaves(restored.state["params"]))
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    result = train(cfg, workdir)  # the next run resumes from step 10 and finishes
    assert result["step"] == 30 and checkpoint_steps(workdir)[-1] == 30


# ----------------------------------------------------------------------------- runs on a bucket


def test_run_on_a_bucket_resumes_and_matches_local_run(reference, fake_bucket, tmp_path, monkeypatch, capsys):
    """A run whose workdir is `gs://...` writes its metrics and TensorBoard events to the bucket,
    prepares the built-in corpus into the local cache, hands the bucket URL to orbax, resumes from
    it, and logs the same losses as the local reference run."""
    import deltares.train as train_module
    from deltares.training.checkpoint import Checkpointer

    handed = []

    def checkpointer(workdir, *args, through=None):
        # orbax writes buckets with tensorstore's own GCS driver, which no fake reaches: the
        # checkpoints of this test go to the bucket's local directory instead.
        handed.append(workdir)
        assert through == workdir  # a bucket is not held open: written by name
        return Checkpointer(workdir.replace("gs://", fake_bucket.root + "/"), *args)

    monkeypatch.setattr(train_module, "Checkpointer", checkpointer)
    evaluate = train_module.evaluate

    def evaluate_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args, **kwargs)

    url = "gs://runs/delta_block"
    cfg = config_with("builtin", **RESUME_OVERRIDES)
    with monkeypatch.context() as patch:
        patch.setattr(train_module, "evaluate", evaluate_then_sigterm)
        first = train(cfg, url)
    assert first["stopped"] == "SIGTERM"
    run_dir = os.path.join(fake_bucket.root, "runs", "delta_block")
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:  # a record after the checkpoint, and one cut short
        f.write('{"step": 25, "loss": 0.0}\n{"step": 2')
    result = train(cfg, url)
    assert result["step"] == STEPS and f"resumed {url} from step {first['step']}" in capsys.readouterr().err
    assert handed == [url, url]

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # nothing lost or doubled on resume
    assert {r["step"]: r["loss"] for r in records} == reference["loss"]
    scalars = tensorboard_scalars(run_dir)
    assert {step for tag, step in scalars if tag == "loss"} == set(range(1, STEPS + 1))
    assert not os.path.exists(os.path.join(run_dir, "dataset"))  # token data stays local
    cached = glob.glob(str(tmp_path / "cache" / "datasets" / "builtin-*" / "meta.json"))
    assert len(cached) == 1
    assert load_checkpoint(run_dir).step == STEPS


def test_training_data_read_from_a_bucket_gives_the_local_losses(reference, builtin_dataset, fake_bucket, tmp_path):
    """The prepared dataset served as gs:// (byte-range reads of its token files, through fsspec as
    gcsfs would): the same batches, so the losses of the run on the local copy, bit for bit."""
    shutil.copytree(builtin_dataset, os.path.join(fake_bucket.root, "data", "builtin"))
    result = train(config_with("gs://data/builtin", **RESUME_OVERRIDES), str(tmp_path / "run"))
    assert result["step"] == STEPS
    assert {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / "run"))} == reference["loss"]
    assert result["val_loss"] == reference["result"]["val_loss"]
