"""Mixtures of prepared datasets (`config.data.mixture`, deltares.data.mixture): proportions, resumed
iterators, disjoint process rows, incompatible sources refused, one consumer reading a mixture and a
dataset alike (deltares.data.source), and a real training run."""

import json
import math

import numpy as np
import pytest

from deltares.data.dataset import train_iterator
from deltares.data.documents import DataError
from deltares.data.mixture import Mixture, parse_mixture
from deltares.data.prepare import prepare
from deltares.data.run_data import open_run_dataset
from deltares.data.source import unigram_perplexity

from debug_runs import config_with, read_metrics

SEQ = 8


def letters_text(letter, n=300):
    return "\n\n".join(f"{letter * 40} {i}" for i in range(n)) + "\n"


def letters_corpus(path, letter, n=300):
    """Documents of one repeated letter: every window of its dataset is recognisable by its bytes."""
    path.write_text(letters_text(letter, n))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for letter in "ab":
        out[letter] = str(root / letter)
        prepare(str(letters_corpus(root / f"{letter}.txt", letter)), "bytes", out[letter], val_fraction=0.1,
                progress=False)
    return out


def source_of(window):
    """0 for a window of the 'a' dataset, 1 for 'b' (every window holds one of the letters)."""
    has_a, has_b = (window == ord("a")).any(), (window == ord("b")).any()
    assert has_a != has_b
    return int(has_b)


def test_parse_mixture():
    assert parse_mixture("x=3,y=1") == [("x", 0.75), ("y", 0.25)]
    for bad in ("x=3", "x=0,y=1", "x=a,y=1", "x,y"):
        with pytest.raises(DataError, match="mixture"):
            parse_mixture(bad)


def test_proportions_hold_within_one_percent(sources):
    mix = Mixture(f"{sources['a']}=0.7,{sources['b']}=0.3")
    ds = mix.train_batches(SEQ, 100, seed=0)
    drawn = [source_of(w) for step in range(100) for w in ds[step]]  # 10,000 windows
    assert len(drawn) == 10_000
    assert abs(np.mean(drawn) - 0.3) < 0.01


def test_resumed_iterator_reads_identical_batches(sources):
    mix = Mixture(f"{sources['a']}=1,{sources['b']}=1")
    it = train_iterator(mix.train_batches(SEQ, 8, seed=3), prefetch=2)
    for _ in range(7):
        next(it)
    saved = json.loads(json.dumps(it.get_state()))
    tail = [np.asarray(next(it)) for _ in range(5)]
    fresh = train_iterator(Mixture(f"{sources['a']}=1,{sources['b']}=1").train_batches(SEQ, 8, seed=3), prefetch=2)
    fresh.set_state(saved)
    for want in tail:
        np.testing.assert_array_equal(np.asarray(next(fresh)), want)


def test_process_rows_are_disjoint_and_make_the_global_batch(sources):
    mix = Mixture(f"{sources['a']}=0.6,{sources['b']}=0.4")
    whole = mix.train_batches(SEQ, 8, seed=1)
    parts = [mix.train_batches(SEQ, 8, seed=1, process_index=p, process_count=2) for p in range(2)]
    for step in range(20):
        rows = np.asarray(whole[step])
        mine = [np.asarray(p[step]) for p in parts]
        np.testing.assert_array_equal(rows[0::2], mine[0])  # each process every other element of the mixture
        np.testing.assert_array_equal(rows[1::2], mine[1])


def test_validation_draws_from_every_source(sources):
    mix = Mixture(f"{sources['a']}=3,{sources['b']}=1")
    batches, bytes_per_token = mix.validation(SEQ, 2, 4)
    drawn = [source_of(w) for b in batches for w in b]
    assert drawn.count(0) == 6 and drawn.count(1) == 2  # round(4 * 0.75) and round(4 * 0.25) batches of 2
    assert bytes_per_token == pytest.approx(1.0)  # the bytes tokenizer: a byte per token


def test_sources_of_other_tokenizers_are_refused(sources, tmp_path):
    other = tmp_path / "gpt2"
    prepare(str(letters_corpus(tmp_path / "c.txt", "c")), "gpt2", str(other), val_fraction=0.1, progress=False)
    with pytest.raises(DataError, match=rf"{sources['a']} and {other} differ in their tokenizer"):
        Mixture(f"{sources['a']}=1,{other}=1")


def test_a_paper_scale_experiment_takes_a_mixture_instead_of_a_dataset():
    """The paper-scale experiments leave data.dataset unset; a mixture is then the data."""
    from deltares.train import TrainError, check_train_config
    from experiments import s220m

    cfg = s220m.get_config("delta")
    with pytest.raises(TrainError, match="data.dataset is not set"):
        check_train_config(cfg)
    cfg.data.mixture = "a=1,b=1"
    check_train_config(cfg)
    cfg.data.dataset = "elsewhere"
    with pytest.raises(TrainError, match="not both"):
        check_train_config(cfg)


def train_windows(dataset, seq_len):
    with open(f"{dataset}/meta.json") as f:
        return (json.load(f)["splits"]["train"]["tokens"] - 1) // seq_len


def consume(source, steps=6):
    """What the trainer reads of a data source, through `DataSource` alone: training windows (and the
    iterator state a checkpoint keeps), validation batches, epochs, the record, the vocabulary."""
    it = train_iterator(source.train_batches(SEQ, 4, seed=2), prefetch=2)
    head = [np.asarray(next(it)) for _ in range(steps)]
    state = json.loads(json.dumps(it.get_state()))
    tail = [np.asarray(next(it)) for _ in range(2)]
    again = train_iterator(source.train_batches(SEQ, 4, seed=2), prefetch=2)
    again.set_state(state)
    assert all(np.array_equal(np.asarray(next(again)), want) for want in tail)
    val, bytes_per_token = source.validation(SEQ, 2, 2)
    return {"train": [w for b in head + tail for w in b], "val": [w for b in val for w in b],
            "bytes_per_token": bytes_per_token, "epochs": source.epochs(100, SEQ), "record": source.record(),
            "unigram_ppl": unigram_perplexity(source), "eos_id": source.eos_id, "vocab_size": source.vocab_size}


def assert_text_of_the_corpora(windows, eos_id):
    """Each window is SEQ + 1 tokens of the letters corpora: bytes of their text, documents ended by eos_id."""
    texts = (letters_text("a"), letters_text("b"))
    for w in windows:
        assert w.dtype == np.int32 and w.shape == (SEQ + 1,)
        assert all(0 < t < 256 or t == eos_id for t in w)
        for piece in bytes(0 if t == eos_id else int(t) for t in w).decode().split("\x00"):
            assert any(piece in text for text in texts)


def test_a_dataset_and_a_mixture_read_alike(sources, tmp_path):
    """The config picks the source once (open_run_dataset); one consumer then reads a dataset and a
    mixture of two, checked against their corpora and meta.json."""
    def config(**data):
        return {"data": {"dataset": "", "mixture": "", **data}, "model": {"vocab_size": 300}}

    one = consume(open_run_dataset(config(dataset=sources["a"]), str(tmp_path)))
    mix = consume(open_run_dataset(config(mixture=f"{sources['a']}=0.5,{sources['b']}=0.5"), str(tmp_path)))
    for got in (one, mix):
        assert_text_of_the_corpora(got["train"] + got["val"], eos_id=256)
        assert (got["eos_id"], got["vocab_size"]) == (256, 257)  # the bytes tokenizer: 256 bytes and end-of-text
        assert got["bytes_per_token"] == pytest.approx(1.0)
        assert 1 < got["unigram_ppl"] < 257
    assert {source_of(w) for w in one["train"] + one["val"]} == {0}
    assert 0.25 < np.mean([source_of(w) for w in mix["train"]]) < 0.75  # 32 windows drawn half and half
    assert [source_of(w) for w in mix["val"]] == [0, 0, 1, 1]  # a batch of 2 from each source
    n_a, n_b = (train_windows(sources[k], SEQ) for k in "ab")
    assert one["epochs"] == pytest.approx(100 / n_a)
    assert mix["epochs"] == pytest.approx(max(50 / n_a, 50 / n_b))
    tokens = {}
    for k in "ab":
        with open(f"{sources[k]}/meta.json") as f:
            tokens[k] = {split: info["tokens"] for split, info in json.load(f)["splits"].items()}
    assert one["record"]["tokens"] == tokens["a"]
    assert mix["record"]["tokens"] == {sources["a"]: tokens["a"], sources["b"]: tokens["b"]}
    assert mix["record"]["mixture"] == [{"path": sources[k], "weight": 0.5} for k in "ab"]
    assert one["record"]["tokenizer_sha256"] == mix["record"]["tokenizer_sha256"]


def test_training_on_a_mixture(sources, tmp_path, capsys):
    """A real run on a mixture; 240 steps of 4 windows at weight 0.5 read source `a` more than once, so
    the run warns at its start and its records count epochs of the source it repeats most."""
    from deltares.train import TrainError, train

    cfg = config_with("builtin", steps=240, log_every=120, eval_every=240, checkpoint_every=240, stats_every=0)
    cfg.data.mixture = f"{sources['a']}=0.5,{sources['b']}=0.5"
    result = train(cfg, str(tmp_path / "run"))
    records = read_metrics(str(tmp_path / "run"))
    assert result["step"] == 240 and math.isfinite(result["val_loss"])
    n_a, n_b = (train_windows(sources[k], cfg.data.seq_len) for k in "ab")
    for record in records:
        expected = max(record["step"] * cfg.train.global_batch * 0.5 / n for n in (n_a, n_b))
        assert record["epoch"] == pytest.approx(expected)
    assert records[-1]["epoch"] > 1
    assert f"{240 * 0.5 * cfg.train.global_batch / min(n_a, n_b):.2f} epochs" in capsys.readouterr().err
    cfg.data.dataset = sources["a"]
    with pytest.raises(TrainError, match="not both"):
        train(cfg, str(tmp_path / "run2"))
