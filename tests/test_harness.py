"""The lm-evaluation-harness model `deltares` (deltares.harness) against lm-eval's own `hf` model.

Reference: lm-eval's `HFLM` running the tiny Qwen3 fixture in torch (`transformers` wrote it),
with the same tokenizer.json, on the same requests and the local tasks in tests/lm_eval_tasks/
(multiple choice and a perplexity task). torch and transformers come from requirements-test.txt.
"""

import json
import os

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from jax_cache import ROOT, run_module  # noqa: E402

from deltares.harness import DeltaresLM, parse_batch_size  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_HF = os.path.join(HERE, "fixtures", "qwen3_tiny")
TASKS = os.path.join(HERE, "lm_eval_tasks")
MAX_LEN = 64  # short, so that the perplexity documents need several rolling windows
with open(os.path.join(TASKS, "deltares_tiny_ppl.jsonl"), encoding="utf-8") as _f:
    LONG_DOC = json.loads(_f.readline())["text"]  # 371 tokens


@pytest.fixture(scope="module")
def hf_lm():
    """lm-eval's `hf` model on the fixture, with the fixture's tokenizer.json as it is (AutoTokenizer
    would build a Qwen2 tokenizer whose pre-tokenizer differs from the file's)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lm_eval.models.huggingface import HFLM

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(TINY_HF, "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    return HFLM(pretrained=TINY_HF, tokenizer=tok, device="cpu", dtype="float32", max_length=MAX_LEN, batch_size=4)


@pytest.fixture(scope="module")
def lm():
    return DeltaresLM.create_from_arg_string(f"checkpoint={TINY_HF},dtype=float32,max_length={MAX_LEN}",
                                             {"batch_size": 4})


def requests(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_same_tokens_and_prefix_as_hf(hf_lm, lm):
    for text in ["Call me ", "The whale was  ", " Ishmael.", "a  b\n\n\t 12345 é 日本", LONG_DOC]:
        assert lm.tok_encode(text) == hf_lm.tok_encode(text)
    assert lm.prefix_token_id == hf_lm.prefix_token_id == 0 and lm.max_length == hf_lm.max_length == MAX_LEN


def test_loglikelihood_agrees_with_hf(hf_lm, lm):
    long_ctx = LONG_DOC
    assert len(lm.tok_encode(long_ctx)) > MAX_LEN + 10  # cut from the left
    pairs = [
        ("Call me", " Ishmael."),
        ("Call me ", "Ishmael."),  # trailing space: moved to the continuation
        ("The whale was  ", "white and vast"),
        ("", "Hello there"),  # empty context: the prefix token
        ("", "<|endoftext|>Hello there"),  # ... unless the continuation starts with it
        (long_ctx, " and the sea"),
        ("Captain", " Ahab"),
    ]
    got = lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    want = hf_lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=0, atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert got[1][0] == pytest.approx(got[0][0], abs=1e-5)  # the trailing space moved to the continuation


def test_loglikelihood_rolling_agrees_with_hf(hf_lm, lm):
    """Per window within 1e-4; a document sums windows that hf adds in float32 (ulp 3e-5 at -400),
    so its total within 1e-4 plus a float32 rounding of it."""
    docs = [LONG_DOC, "Short.", "It was the best of times, it was the worst of times.", ""]
    windows = [(None,) + make_disjoint_window(w) for w in get_rolling_token_windows(lm.tok_encode(LONG_DOC), 0,
                                                                                       MAX_LEN, 1)]
    assert len(windows) == 6
    got = lm._loglikelihood_tokens(windows, disable_tqdm=True)
    want = hf_lm._loglikelihood_tokens(windows, disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=0, atol=1e-4)
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
    want = hf_lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-4)
    assert got[-1] == 0  # an empty document has no windows


def test_generate_until_agrees_with_hf(hf_lm, lm):
    args = [("Call me", {"until": ["\n"], "max_gen_toks": 8}),
            ("The whale", {"until": [".", ","], "max_gen_toks": 12, "do_sample": False}),
            (LONG_DOC[:500], {"until": ["\n\n"], "max_gen_toks": 6})]  # context cut to max_length - 6
    got = lm.generate_until(requests("generate_until", args), disable_tqdm=True)
    want = hf_lm.generate_until(requests("generate_until", args), disable_tqdm=True)
    assert got == want and all(got)
    with pytest.raises(ValueError, match="max_gen_toks=64 must be less than max_length=64"):
        lm.generate_until(requests("generate_until", [("x", {"max_gen_toks": 64})]), disable_tqdm=True)


@pytest.fixture(scope="module")
def evaluations(hf_lm, lm):
    """lm_eval.simple_evaluate of both models on the two local tasks, samples logged."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=TASKS)  # indexes all of lm-eval's tasks: once
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the task YAMLs name their JSONL files from the repository root
        return {name: simple_evaluate(model=model, tasks=["deltares_tiny", "deltares_tiny_ppl"], log_samples=True,
                                      task_manager=tasks, bootstrap_iters=0)
                for name, model in (("hf", hf_lm), ("deltares", lm))}


def test_simple_evaluate_agrees_with_hf(evaluations):
    hf, ours = evaluations["hf"], evaluations["deltares"]
    for task, n_docs in (("deltares_tiny", 6), ("deltares_tiny_ppl", 4)):
        got = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        want = sorted(hf["samples"][task], key=lambda s: s["doc_id"])
        assert len(got) == len(want) == n_docs
        for g, w in zip(got, want):
            assert g["arguments"] == w["arguments"]
            flat = lambda s: np.asarray([r[0] if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]],  # noqa: E731
                                        dtype=np.float64).ravel()
            np.testing.assert_allclose(flat(g), flat(w), rtol=1e-7 if task.endswith("ppl") else 0, atol=1e-4)
    assert ours["results"]["deltares_tiny"]["acc,none"] == hf["results"]["deltares_tiny"]["acc,none"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["deltares_tiny_ppl"][metric] == pytest.approx(hf["results"]["deltares_tiny_ppl"][metric],
                                                                             rel=1e-5)


def test_batch_size_auto_searches_the_largest_batch_that_runs(lm, monkeypatch):
    for bad in ("auto:4", "0", "eight", -2):
        with pytest.raises(ValueError, match="positive integer or 'auto'"):
            parse_batch_size(bad)
    with pytest.raises(ValueError, match="unknown deltares model arguments: max_lenght"):
        DeltaresLM(checkpoint=TINY_HF, max_lenght=12)
    pairs = [("Call me", " Ishmael."), ("The sea was", " calm"), ("", "Hello"), ("Captain", " Ahab"), ("A", " b")]
    fixed = lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)

    scorer, tried = lm._token_logprobs, []

    def fails_above_two(params, inputs_BT, targets_BT):
        tried.append(inputs_BT.shape[0])
        if inputs_BT.shape[0] > 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return scorer(params, inputs_BT, targets_BT)

    monkeypatch.setattr(lm, "_token_logprobs", fails_above_two)
    monkeypatch.setattr(lm, "max_batch_size", 8)
    monkeypatch.setattr(lm, "_rows", None)
    auto = lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    assert tried[:3] == [8, 4, 2] and set(tried[3:]) == {2} and lm.rows_per_batch() == 2
    np.testing.assert_allclose([a[0] for a in auto], [f[0] for f in fixed], rtol=0, atol=1e-5)

    monkeypatch.setattr(lm, "_rows", None)  # other errors are not taken for a full device
    monkeypatch.setattr(lm, "_token_logprobs", lambda *a: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INTERNAL")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        lm.rows_per_batch()


def test_harness_scores_like_the_model(lm):
    tok, forward = lm.tokenizer, jax.jit(lm.model.apply)
    pairs = [("Call me", " Ishmael."), ("The whale", " was white and vast"), ("", "Hello there")]
    got = lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        ctx_ids, cont_ids = tok.encode(ctx) or [tok.eos_id], tok.encode(cont)
        seq = jnp.asarray([ctx_ids + cont_ids])
        logp_TV = jax.nn.log_softmax(forward({"params": lm.params}, seq[:, :-1])[0], axis=-1)
        picked = [float(logp_TV[len(ctx_ids) - 1 + i, t]) for i, t in enumerate(cont_ids)]
        assert logp == pytest.approx(sum(picked), abs=1e-4)
        argmax = [int(jnp.argmax(logp_TV[len(ctx_ids) - 1 + i])) for i in range(len(cont_ids))]
        assert greedy == (argmax == cont_ids)

    text = "It was the best of times, it was the worst of times."
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    ids = [tok.eos_id] + tok.encode(text)  # shorter than the context: one window after end-of-text
    logp_TV = jax.nn.log_softmax(forward({"params": lm.params}, jnp.asarray([ids[:-1]]))[0], axis=-1)
    assert rolling == pytest.approx(float(sum(logp_TV[i, t] for i, t in enumerate(ids[1:]))), abs=1e-3)

    out = lm.generate_until([Instance("generate_until", {}, ("Call me", {"until": ["\n"], "max_gen_toks": 6}), 0)],
                            disable_tqdm=True)
    assert isinstance(out[0], str) and "\n" not in out[0]


# ----------------------------------------------------------------------------- command line


def test_model_arguments_outside_their_range_are_refused_before_loading():
    for name in ("max_length", "max_batch_size"):
        for bad in (0, -1, float("nan"), float("inf"), 10**30, "many"):
            with pytest.raises(ValueError, match=f"{name}="):
                DeltaresLM(checkpoint="/nonexistent", **{name: bad})


def test_harness_cli_runs_a_local_task(converted_run_dir, tmp_path):
    proc = run_module("deltares.harness", "--model", "deltares", "--model_args", f"checkpoint={converted_run_dir}",
                      "--tasks", "deltares_tiny", "--include_path", "tests/lm_eval_tasks", "--batch_size", "auto",
                      "--max_batch_size", "4", "--output_path", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deltares_tiny" in proc.stdout and "acc" in proc.stdout
    assert "batch_size=auto: the largest batch that runs is 4" in proc.stdout
    assert any(f.endswith(".json") for _, _, files in os.walk(tmp_path / "results") for f in files)

    proc = run_module("deltares.harness", "--model", "deltares", "--model_args", f"checkpoint={converted_run_dir}",
                      "--tasks", "no_such_task_xyz")
    assert proc.returncode != 0 and "no_such_task_xyz" in proc.stderr + proc.stdout

    proc = run_module("deltares.harness", "--model", "deltares", "--model_args", f"checkpoint={converted_run_dir}",
                      "--tasks", "deltares_tiny", "--include_path", "tests/lm_eval_tasks", "--batch_size", "auto:4")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "error: batch_size='auto:4': must be a positive integer or 'auto'" in proc.stderr

