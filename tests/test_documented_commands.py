"""Every documented command and Python snippet runs.

The commands are collected from README.md, launch/README.md, examples/README.md, docs/**
(markdown and .sh) and the docstrings of experiments/*.py: fenced shell blocks and inline code
spans that start with `python -m`, `bash` or a `launch/` or `docs/` script, joined across
backslash continuations, with `for` loops kept whole. The Python snippets are the ```python blocks of the same markdown:
each runs as printed, as a script of its own (`python snippets/<hash>.py` in the workspace), with
the placeholders of STAND_INS replaced as in the commands (a snippet that needs a stand-in gets it
from that table; a snippet must be complete: its imports and its data). One table, RULES, says how
each command runs:

- small scales and the tools for real, with shortening flags appended (few steps, few batches),
- paper scales with the trainer's `--dry_run` (flags, config, abstract parameters and step),
- launch scripts with `--dry-run`,
- the reproduction script with fewer steps on a small corpus, and the lines of that script
  (and their copy in its README) checked to be the ones the script runs.

Placeholders (DATA, a Qwen3 directory, a bucket, hub datasets and tasks, ...) become local
stand-ins through one table, STAND_INS, each with its reason. The commands and snippets run as
subprocesses in one temporary workspace that holds the paths they expect (`runs/demo` is made by
the documented demo command itself, shortened, before the commands that read it). A command or
snippet printed in several places runs once. A command that no rule classifies fails the test,
so new documentation cannot slip past.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.jax_cache import ENV, ROOT

# ----------------------------------------------------------------------------- collection

PROSE_SOURCES = ("README.md", "launch/README.md", "examples/README.md", "docs/**/*.md")
SCRIPT_SOURCES = ("docs/**/*.sh",)
DOCSTRING_SOURCES = ("experiments/*.py",)
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
PYTHON_FENCES = ("python", "py")
COMMAND_START = re.compile(r"(python -m \S+|bash \S+|(?:\./)?(?:launch|docs)/\S+\.sh|launch/\S+\.py)(?=\s|$)")
FENCE = re.compile(r"^\s*```\s*([\w-]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Doc:
    source: str  # path relative to the repository root
    line: int
    command: str  # as printed (continuations joined, comments and trailing prose cut); a snippet's code
    language: str = "shell"  # or "python": a snippet, run as a script


def _statements(lines):
    """(first line number, text) of each shell statement: backslash continuations joined."""
    out, start, parts = [], None, []
    for number, line in lines:
        if start is None:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped.strip())
        out.append((start, " ".join(p for p in parts if p)))
        start, parts = None, []
    if parts:
        out.append((start, " ".join(parts)))
    return out


def _strip_comment(text: str) -> str:
    """`cmd args   # note` -> `cmd args` (a `#` after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _shell_commands(lines):
    """Commands of a shell block; a multi-line `for ...; do` ... `done` becomes one command."""
    out, loop = [], None
    for number, text in _statements(lines):
        text = _strip_comment(text)
        if loop is not None:
            if text == "done":
                out.append((loop[0], f"{loop[1]} {'; '.join(loop[2])}; done"))
                loop = None
            elif text:
                loop[2].append(text)
            continue
        if text.startswith("for ") and text.endswith("; do"):
            loop = (number, text, [])
        elif COMMAND_START.match(text) or (text.startswith("for ") and COMMAND_START.search(text)):
            out.append((number, text))
    return out


def markdown_snippets(text: str):
    """(first line number, code) of every ```python block."""
    out, fence, block, start = [], None, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match and fence is None:
            fence, block, start = match.group(1).lower(), [], number + 1
        elif match and not match.group(1):
            if fence in PYTHON_FENCES:
                out.append((start, "\n".join(block) + "\n"))
            fence = None
        elif fence is not None:
            block.append(line)
    return out


def markdown_commands(text: str):
    lines = text.splitlines()
    prose, fence, block = [], None, []
    out = []
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if match and fence is None:
            fence, block = match.group(1).lower(), []
        elif match and not match.group(1):
            if fence in SHELL_FENCES:
                out += _shell_commands(block)
            fence = None
        elif fence is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    joined = "\n".join(line for _, line in prose)
    numbers = [n for n, line in prose for _ in range(len(line) + 1)]
    for match in re.finditer(r"`([^`]+)`", joined):
        span = " ".join(match.group(1).split())
        start = COMMAND_START.match(span)
        if start and start.end() < len(span):  # a tool's or script's bare name is no command
            out.append((numbers[match.start()], span))
    return out


def docstring_commands(text: str):
    """`Run: python -m ...  (prose)` lines and `for` loops of a module docstring."""
    lines = [(n, re.sub(r"^\s*(Run|Bench|Export|Test):\s+", "", line)) for n, line in enumerate(text.splitlines(), 1)]
    out = []
    for number, statement in _statements(lines):
        statement = re.split(r"\s{2,}\(", statement)[0]  # two spaces, then "(...)": prose
        statement = " ".join(statement.split())  # a backslash-newline inside a docstring leaves spaces
        if COMMAND_START.match(statement) or (statement.startswith("for ") and COMMAND_START.search(statement)):
            out.append((number, statement))
    return out


def _docstring(path: str) -> str:
    import ast

    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read()), clean=False) or ""


def collect() -> list[Doc]:
    docs = []

    def paths(patterns):
        return sorted({p for pattern in patterns for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)})

    for path in paths(PROSE_SOURCES):
        with open(path) as f:
            text = f.read()
        docs += [Doc(os.path.relpath(path, ROOT), n, c) for n, c in markdown_commands(text)]
        docs += [Doc(os.path.relpath(path, ROOT), n, c, "python") for n, c in markdown_snippets(text)]
    for path in paths(SCRIPT_SOURCES):
        with open(path) as f:
            found = _shell_commands(list(enumerate(f.read().splitlines(), 1)))
        docs += [Doc(os.path.relpath(path, ROOT), n, c) for n, c in found]
    for path in paths(DOCSTRING_SOURCES):
        docs += [Doc(os.path.relpath(path, ROOT), n, c) for n, c in docstring_commands(_docstring(path))]
    return docs


# ----------------------------------------------------------------------------- stand-ins


@dataclasses.dataclass(frozen=True)
class StandIn:
    placeholder: str  # a regular expression over the command as printed
    replacement: str  # `{name}`: a path of the workspace (see `workspace`)
    reason: str


# Every placeholder of the documentation and what it becomes here, applied in this order.
STAND_INS = (
    StandIn(r"/models/Qwen3-0\.6B|/path/to/Qwen3-0\.6B", "{qwen3}",
            "no Qwen3-0.6B here (1.2 GB, no network): the tiny random Qwen3 of tests/fixtures, same files"),
    StandIn(r"(?<=--mode delta_block )--block_layers 4", "--block_layers 3",
            "4 layers per block suits Qwen3-0.6B's 28 layers; the fixture has 3"),
    StandIn(r"(?<![$\w])DATA\b", "{demo}/dataset",
            "a prepared FineWeb-Edu: the demo run's prepared Moby-Dick (the dry runs do not read it)"),
    StandIn(r"hf:HuggingFaceFW/fineweb-edu", "hf:{hf_dataset}",
            "the Hub needs the network: a local Hugging Face dataset (datasets.save_to_disk) of 120 documents, "
            "which deltares.data.prepare reads by its data files as it reads a Hub dataset's"),
    StandIn(r"gs://(BUCKET|my-bucket)/", "{bucket}/", "no GCS here: a local directory (the dry runs only print it)"),
    StandIn(r"'texts/\*\.txt\.gz'", "'{texts}/*.txt.gz'", "your text files: a gzipped excerpt of Moby-Dick"),
    StandIn(r"\bsome_text\.txt\b", "{texts}/some_text.txt", "a plain text file: an excerpt of Moby-Dick"),
    StandIn(r"\bruns/x/checkpoints/200\b", "{demo}/checkpoints/{demo_steps}",
            "a checkpoint step directory: the last step of the shortened demo"),
    StandIn(r"\bruns/(tiny_delta_block|tiny_block_attnres|ft_delta_block)(?=\s|$)", "{links}/\\1",
            "trained runs of these names (a run each would not fit a test's time): links to the demo run"),
    StandIn(r"/path/to/out\b", "exports/finetuned", "an output directory of your choice"),
    StandIn(r"/tmp/analysis\b", "analysis_out", "an output directory: kept inside the workspace"),
    StandIn(r"(?<=--bench )runs/gpu_bench\b", "{gpu_bench}",
            "a GPU bench's output folder (no GPU here): one made in the workspace, its programs a hand-written HLO"),
    StandIn(r"--tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande,boolq,mmlu,lambada_openai(?=\s|$)",
            "--tasks deltares_tiny --include_path {tasks}",
            "the paper's 8 tasks download their data from the Hub: the offline task of tests/lm_eval_tasks"),
    StandIn(r"FILE:MODE --workdir DIR \[overrides\]", "experiments/debug.py:delta_block --workdir runs/template",
            "a template of the trainer's command: one instance, the smallest experiment"),
    StandIn(r"<scale>", "s220m", "a template over the scales: one instance (each scale has its own command)"),
    StandIn(r"<mode>", "delta_block", "a template over the modes: one instance"),
    StandIn(r" \[--json\]", " --json", "an optional flag: given"),
    StandIn(r"(?<=launch/tpu\.sh --dry-run) \.\.\.$",
            " --name my-tpu --zone us-east5-a --type v5p-16 --config experiments/s7b6.py:delta_block "
            "--workdir {bucket}/s7b6", "`...`: the arguments of the example above it"),
    StandIn(r"--config \.\.\. --workdir \.\.\.", "--config experiments/s220m.py:delta_block --workdir runs/x",
            "`...`: the arguments of the example above it"),
    StandIn(r"(?<=\.py:delta) \.\.\. (?=--)|(?<=\.py:delta_block) \.\.\.$",
            " --name my-tpu --zone us-east5-a --workdir {bucket}/run ",
            "`...` in the hardware table: the name, zone and workdir of the example above it"),
)


def substitute(command: str, paths: dict, used: set | None = None) -> str:
    """The command with every placeholder replaced by its stand-in (`used` collects the
    placeholders that occurred)."""
    for s in STAND_INS:
        command, n = re.subn(s.placeholder, s.replacement.format(**paths), command)
        if n and used is not None:
            used.add(s.placeholder)
    return command.rstrip()


# ----------------------------------------------------------------------------- how each runs

PAPER_SCALES = "s220m|s533m|s1044m|qwen3_0p6b|s7b6|finetune_qwen3_0p6b"
DEMO_STEPS = 3
SHORT_TRAIN = tuple(f"--config.train.{key}={value}" for key, value in (
    ("steps", DEMO_STEPS), ("eval_every", DEMO_STEPS), ("checkpoint_every", DEMO_STEPS), ("eval_batches", 2),
    ("log_every", 1), ("stats_every", DEMO_STEPS)))
# A paper-scale architecture shrunk to seconds for the tools that compile or time a real step
# (bench, aot); the trainer's own paper-scale commands are dry-run at full size instead.
SHRINK = ("--config.model.n_layers=2", "--config.model.d_model=64", "--config.model.n_heads=2",
          "--config.model.n_kv_heads=1", "--config.model.head_dim=32", "--config.model.d_ff=128",
          "--config.model.vocab_size=512", "--config.model.residual.block_layers=1")
SHORT_BENCH = ("--rounds", "1", "--steps", "1", "--batch", "2", "--seq_len", "32")


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    pattern: str  # searched in the command after the stand-ins
    how: str  # run | dry_run | launch | in_script | not_run | python (a snippet, run as a script)
    extra: tuple = ()  # appended: shortening flags (inside a `for` loop: to its command)
    shorten: tuple = ()  # (regex, replacement) applied after the stand-ins
    source: str = ""  # a regex the source path must match
    env: tuple = ()  # (name, value with {paths}) set for the command
    first: bool = False  # runs first: its output (the demo run) is read by others
    timeout: int = 600
    check: str = ""  # a named check of the output (see CHECKS)
    reason: str = ""


RULES = (
    Rule("pytest", r"^python -m pytest\b", "not_run", reason="the test suite itself: CI runs it"),
    Rule("reference pages", r"^python -m tests\.reference_pages$", "not_run",
         reason="tests/test_docs.py runs its generator and compares the pages with the committed ones"),
    Rule("reproduction script lines", ".", "in_script", source=r"^docs/results/reproduction/run\.sh$",
         reason="a line of docs/results/reproduction/run.sh, which runs as a whole below"),
    Rule("reproduction script", r"^bash docs/results/reproduction/run\.sh all runs/study$", "run",
         env=(("CORPORA", "{corpora}"), ("STEPS", "2"), ("LONG_STEPS", "2"), ("SEEDS", "0"), ("MODES", "delta_block"), ("FAMILY_MODES", "hyper"),
              ("EVAL_BATCHES", "2"), ("DEEP_LAYERS", "3")),
         timeout=900, reason="every part, 2 steps per run of delta_block, one seed, on Moby-Dick, 2 evaluation "
                             "batches, the depth part's deeper model at 3 layers (24 compile for minutes unrolled)"),
    Rule("reproduction part", r"^bash docs/results/reproduction/run\.sh \w+ runs/study$", "not_run",
         reason="one part of `run.sh all`, which runs below"),
    Rule("reproduction, written out", ".", "in_script", source=r"^docs/results/reproduction/README\.md$",
         reason="what docs/results/reproduction/run.sh runs, written out in its README: checked against the script"),
    Rule("the demo", r"^python -m deltares\.train --config experiments/tiny\.py:delta_block --workdir runs/demo$",
         "run", extra=SHORT_TRAIN, first=True, reason="3 steps; its run directory is read by the tools' commands"),
    Rule("paper-scale training", rf"^(for .*; do )?python -m deltares\.train --config experiments/({PAPER_SCALES})\.py",
         "dry_run", extra=("--dry_run",), check="dry_run", reason="flags, config, abstract parameters and step"),
    Rule("depth-study training", r"^python -m deltares\.train --config experiments/tiny_deep\.py:delta_block ", "dry_run",
         extra=("--dry_run",), check="dry_run",
         reason="the reproduction script's depth part trains this very command (below), for real"),
    Rule("small-scale training", r"^python -m deltares\.train --config experiments/(tiny|tiny_deep|debug)\.py", "run",
         extra=SHORT_TRAIN, reason="3 steps"),
    Rule("data preparation", r"^python -m deltares\.data\.prepare ", "run"),
    Rule("input check", r"^python -m deltares\.common\.inputs ", "run"),
    Rule("evaluation", r"^python -m deltares\.eval ", "run"),
    Rule("generation", r"^python -m deltares\.generate ", "run", check="generated"),
    Rule("lm-eval harness", r"^python -m deltares\.harness ", "run"),
    Rule("analysis", r"^python -m deltares\.analyze ", "run", extra=("--max_batches", "1", "--batch", "2")),
    Rule("comparison", r"^python -m deltares\.compare ", "run"),
    Rule("conversion", r"^python -m deltares\.convert ", "run"),
    Rule("benchmark, paper scale", rf"^python -m deltares\.bench --config experiments/({PAPER_SCALES})\.py", "run",
         extra=SHORT_BENCH + SHRINK, reason="the architecture shrunk (SHRINK), 1 round of 1 step"),
    Rule("benchmark", r"^python -m deltares\.bench --config experiments/(tiny|debug)\.py", "run",
         extra=SHORT_BENCH + ("--modes", "baseline"), reason="baseline only, 1 round of 1 step"),
    Rule("AOT proof, paper scale", rf"^python -m deltares\.aot --config experiments/({PAPER_SCALES})\.py", "run",
         extra=SHRINK + ("--config.train.global_batch=8", "--config.data.seq_len=64"),
         reason="the architecture shrunk (SHRINK): a full-size TPU compile takes minutes"),
    Rule("AOT proof", r"^python -m deltares\.aot --config experiments/(tiny|debug)\.py", "run"),
    Rule("AOT proof, a deep stack on a GPU", r"^for m in baseline delta; do python -m deltares\.aot --config "
         r"experiments/tiny_deep\.py:\$m --gpu ", "run",
         extra=("--config.model.n_layers=3", "--config.data.seq_len=64"),
         reason="3 layers (one block) of 64 tokens: 24 layers of 2048 compile for a minute"),
    Rule("kernel benchmark", r"^python -m kernels_pallas\.depth_route\.bench\b", "run",
         extra=("--cpu_tokens", "64", "--iters", "1"), reason="64 tokens, 1 timed call"),
    Rule("own-model example", r"^python -m examples\.\w+$", "run", reason="a few steps already (no flags)"),
    Rule("fault table", r"^python -m tests\.faults\b", "run", extra=("--only", "checkpoints is a file"),
         shorten=(r"( --only (\w+|'[^']*'))+", ""),
         reason="one fault (and the reference run) in place of the command's own: the whole table takes minutes"),
    Rule("GPU model calibration from a bench", r"^python -m tests\.gpu_calibration --bench ", "run",
         extra=("--rows", "bench"), reason="the stand-in bench folder's rows only: priced and fitted, nothing compiled"),
    Rule("GPU model calibration", r"^python -m tests\.gpu_calibration\b", "run",
         extra=("--rows", "s220m baseline attn=cudnn"),
         reason="one row, compiled for the H200 in seconds (all 26 take about 10 minutes)"),
    Rule("data benchmark", r"^python -m tests\.bench_data\b", "run",
         extra=("--sizes", "1", "--read_seconds", "1", "--workers", "2", "--shards", "1", "--formats", "jsonl.zst"),
         reason="1 MB of .jsonl.zst records, 2 workers (the full benchmark prepares 1.1 GB of each format in 4 ways; "
                "tests/test_prepare.py prepares every format)"),
    Rule("SLURM on this machine", r"^python -m tests\.slurm_local (start|stop) ", "not_run",
         reason="needs root and slurm-wlm, and starts daemons: tests/test_slurm.py runs these two commands (with "
                "--nodes 4, in a folder of its own) around its jobs, and the launcher's jobs on that cluster"),
    Rule("launch script", r"^(bash )?launch/(tpu|gpu|slurm)\.sh ", "launch", check="launch",
         reason="--dry-run: prints every command (no cloud, no GPU)"),
    Rule("GPU measurement script", r"^launch/gpu_bench\.py ", "launch", check="launch",
         reason="--dry-run: prints every mode's command and the plan (no GPU; tests/test_launch.py checks their "
                "settings and runs the script with a fake Python)"),
)


# Every ```python block of the docs: a script of its own, as printed but for the stand-ins. Offline: a
# snippet reads only local files (the Qwen3 stand-in is the tiny fixture; torch and transformers, which the
# fine-tuning page's snippet loads its export with, come from requirements-test.txt as in CI).
SNIPPET = Rule("python snippet", ".", "python", env=(("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")),
               reason="runs as a script in the workspace")
SNIPPETS_DIR = "snippets"


def snippet_file(doc: Doc, paths: dict) -> tuple[str, str]:
    """(path relative to the workspace, code) of a snippet after the stand-ins: one file per distinct
    code, so a snippet printed on several pages runs once."""
    code = substitute(doc.command, paths) + "\n"
    digest = hashlib.sha1(code.encode()).hexdigest()[:12]
    return f"{SNIPPETS_DIR}/{digest}.py", code


def classify(doc: Doc, paths: dict) -> Rule | None:
    if doc.language == "python":
        return SNIPPET
    command = substitute(doc.command, paths)
    for rule in RULES:
        if re.search(rule.source, doc.source) and re.search(rule.pattern, command):
            return rule
    return None


def runnable(doc: Doc, rule: Rule, paths: dict) -> str:
    """The shell command that runs `doc` under `rule` (a snippet: `python` on its file, see
    `snippet_file`)."""
    if rule.how == "python":
        return f"python {snippet_file(doc, paths)[0]}"
    command = substitute(doc.command, paths)
    if rule.shorten:
        command = re.sub(rule.shorten[0], rule.shorten[1], command)
    if rule.how == "launch" and "--dry-run" not in command.split():
        command = re.sub(r"^((bash )?launch/\w+\.(sh|py))", r"\1 --dry-run", command)
    extra = " ".join(shlex.quote(e) for e in rule.extra)
    if extra and command.endswith("; done"):
        return command[: -len("; done")] + f" {extra}; done"
    return f"{command} {extra}".strip()


def script_covers(doc: Doc, script_text: str) -> list[str]:
    """What of `doc` (a script line, or its copy in a README) the script does not run: its
    tool and every `--flag` it passes must appear in the script."""
    tool = re.search(r"python -m (\S+)", doc.command)
    wanted = ([f"python -m {tool.group(1)}"] if tool else []) + re.findall(r"(?<!\S)--[\w.]+", doc.command)
    return [w for w in wanted if w not in script_text]


# ----------------------------------------------------------------------------- the workspace

# What the collection found once the README's sections had moved into docs/ (issue 25): 107
# commands (README.md 4, launch/README.md 6, examples/README.md 2, docs/ 82, experiments 13) and 8
# Python snippets. The collection must find at least this many: fewer means it stopped seeing a kind
# of block.
MIN_DOCUMENTED = 100


def _excerpt(path: str, n_bytes: int) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read(n_bytes)
    return text[: text.rfind("\n\n")] + "\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory holding the paths the commands expect (experiments/, launch/, requirements.txt
    and the lm-eval task linked from the repository, a copy of the reproduction script) and the
    stand-ins of STAND_INS; returns (directory, {stand-in name: path})."""
    ws = tmp_path_factory.mktemp("documented")
    for name in ("experiments", "launch", "requirements.txt", "tests/lm_eval_tasks"):  # read only
        os.makedirs(os.path.dirname(ws / name), exist_ok=True)
        os.symlink(os.path.join(ROOT, name), ws / name)
    os.makedirs(ws / "docs" / "results" / "reproduction")
    with open(os.path.join(ROOT, "docs", "results", "reproduction", "run.sh")) as f:
        (ws / "docs" / "results" / "reproduction" / "run.sh").write_text(f.read())
    moby = os.path.join(ROOT, "deltares", "data", "assets", "mobydick.txt.gz")
    os.makedirs(ws / "texts")
    with gzip.open(ws / "texts" / "excerpt.txt.gz", "wt", encoding="utf-8") as f:
        f.write(_excerpt(moby, 200_000))
    (ws / "texts" / "some_text.txt").write_text(_excerpt(moby, 60_000))
    os.makedirs(ws / "corpora")
    os.symlink(moby, ws / "corpora" / "mobydick.txt.gz")
    os.makedirs(ws / "runs")
    os.makedirs(ws / "links")
    for name in ("tiny_delta_block", "tiny_block_attnres", "ft_delta_block"):
        os.symlink(ws / "runs" / "demo", ws / "links" / name)
    os.makedirs(ws / "bucket")
    import datasets

    paragraphs = [p for p in _excerpt(moby, 400_000).split("\n\n") if len(p) > 200][:120]
    datasets.Dataset.from_dict({"text": paragraphs}).save_to_disk(str(ws / "hf_fineweb"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(ws / "corpus")  # records as published: Parquet files, and JSON Lines in zstd on the "bucket"
    os.makedirs(ws / "bucket" / "corpus")
    for i in range(2):
        part = paragraphs[i * 60 : (i + 1) * 60]
        pq.write_table(pa.table({"text": part}), str(ws / "corpus" / f"part{i}.parquet"))
        with pa.CompressedOutputStream(str(ws / "bucket" / "corpus" / f"part{i}.jsonl.zst"), "zstd") as f:
            f.write("".join(json.dumps({"text": p}) + "\n" for p in part).encode())
    _gpu_bench_folder(ws / "gpu_bench")
    paths = dict(
        gpu_bench=str(ws / "gpu_bench"),
        qwen3=os.path.join(ROOT, "tests", "fixtures", "qwen3_tiny"),
        tasks=os.path.join(ROOT, "tests", "lm_eval_tasks"),
        demo=str(ws / "runs" / "demo"),
        demo_steps=DEMO_STEPS,
        links=str(ws / "links"),
        texts=str(ws / "texts"),
        corpora=str(ws / "corpora"),
        hf_dataset=str(ws / "hf_fineweb"),
        bucket=str(ws / "bucket"),
    )
    return str(ws), paths


GPU_BENCH_HLO = """HloModule jit_step, entry_computation_layout={()->()}

ENTRY %main (x: f32[SIZE]) -> f32[SIZE] {
  %x = f32[SIZE]{0} parameter(0)
  ROOT %y = f32[SIZE]{0} copy(%x)
}
"""


def _gpu_bench_folder(folder) -> None:
    """An output folder of launch/gpu_bench.py (env.json, rows.jsonl, programs.tar): s220m baseline and
    delta_block, each a one-copy program."""
    import io
    import tarfile

    os.makedirs(folder)
    with open(folder / "env.json", "w") as f:
        json.dump(dict(gpu="NVIDIA H200", date="2026-12-06 10:00 UTC", commit="0000000"), f)
    with open(folder / "rows.jsonl", "w") as f, tarfile.open(folder / "programs.tar", "w") as tar:
        for mode, n, ms in (("baseline", 2**26, 0.06), ("delta_block", 2**27, 0.12)):
            name = f"s220m_defaults.{mode}.hlo.gz"
            f.write(json.dumps(dict(stage="s220m_defaults", setting="s220m defaults", mode=mode, what="timing",
                                    scale="s220m", n_layers=12, median_ms=ms, step_ms=[ms], program=name)) + "\n")
            data = gzip.compress(GPU_BENCH_HLO.replace("SIZE", str(n)).encode())
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def command_env(rule: Rule, paths: dict) -> dict:
    env = {k: v for k, v in ENV.items() if not k.startswith("DELTARES_")}  # launch settings from the caller
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))  # `python`: this one
    env.update({name: value.format(**paths) for name, value in rule.env})
    return env


def _generated(doc: Doc, out: str) -> str:
    """A generation example must continue each of its prompts by at least one token."""
    lines = out.splitlines()
    for prompt in re.findall(r'--prompt "([^"]+)"', doc.command):
        if not any(line.startswith(prompt) and line != prompt for line in lines):
            return f"no text generated after the prompt {prompt!r}"
    return ""


def _dry_runs(doc: Doc, out: str) -> str:
    """One dry-run summary per run: per value of a `for` loop."""
    loop = re.match(r"for \w+ in ([^;]*);", doc.command)
    wanted = len(loop.group(1).split()) if loop else 1
    got = len(re.findall(r"^dry run of .*: config valid;", out, re.M))
    return "" if got == wanted else f"{got} dry-run summaries printed, expected {wanted}"


CHECKS = {
    "dry_run": _dry_runs,
    "generated": _generated,
    "launch": lambda doc, out: "" if re.search(r"^\+ ", out, re.M) else "no command printed",
}


@dataclasses.dataclass
class Outcome:
    command: str
    docs: list
    rule: Rule
    seconds: float = 0.0
    problem: str = ""


def reads_demo(outcome: Outcome, paths: dict) -> bool:
    """Whether the command reads the demo run (dry runs and launch scripts only name paths)."""
    return outcome.rule.how == "run" and any(p in outcome.command for p in (paths["demo"], "runs/demo", paths["links"]))


def run_one(outcome: Outcome, ws: str, paths: dict, log: str) -> Outcome:
    start = time.perf_counter()
    try:
        proc = subprocess.run(["bash", "-eo", "pipefail", "-c", outcome.command], cwd=ws,
                              env=command_env(outcome.rule, paths), capture_output=True, text=True,
                              timeout=outcome.rule.timeout)
    except subprocess.TimeoutExpired:
        outcome.problem = f"timed out after {outcome.rule.timeout} s"
    else:
        out = proc.stdout + proc.stderr
        with open(log, "w") as f:
            f.write(f"$ {outcome.command}\n{out}")
        if proc.returncode != 0:
            outcome.problem = f"exit status {proc.returncode}:\n" + "\n".join(out.strip().splitlines()[-25:])
        elif outcome.rule.check:
            outcome.problem = CHECKS[outcome.rule.check](outcome.docs[0], out)
    outcome.seconds = time.perf_counter() - start
    return outcome


def test_every_documented_command_is_classified(workspace):
    _, paths = workspace
    docs = collect()
    unclassified = [f"{d.source}:{d.line}: {d.command}" for d in docs if classify(d, paths) is None]
    assert not unclassified, "documented commands that no rule of RULES classifies:\n" + "\n".join(unclassified)
    assert len(docs) >= MIN_DOCUMENTED, f"collected {len(docs)} documented commands, counted {MIN_DOCUMENTED}"
    used = set()
    for d in docs:
        substitute(d.command, paths, used)
    unused = [s.placeholder for s in STAND_INS if s.placeholder not in used]
    assert not unused, f"stand-ins that no documented command needs any more (remove them): {unused}"


def test_documented_commands_run(workspace):
    ws, paths = workspace
    docs = collect()
    only = os.environ.get("DELTARES_DOCS_ONLY", "")  # a regex: run only these commands (while editing docs)
    outcomes, not_run = {}, []
    for doc in docs:
        rule = classify(doc, paths)
        assert rule is not None, f"{doc.source}:{doc.line}: unclassified: {doc.command}"
        if rule.how in ("not_run", "in_script"):
            not_run.append((doc, rule))
            continue
        command = runnable(doc, rule, paths)
        searched = command
        if rule.how == "python":  # its file in the workspace (the same code: the same file)
            name, code = snippet_file(doc, paths)
            os.makedirs(os.path.join(ws, SNIPPETS_DIR), exist_ok=True)
            with open(os.path.join(ws, name), "w") as f:
                f.write(code)
            searched = f"{command}\n{doc.source}\n{code}"
        if only and not rule.first and not re.search(only, searched):
            continue
        outcomes.setdefault(command, Outcome(command, [], rule)).docs.append(doc)

    problems = []
    for doc, rule in not_run:
        if rule.how == "in_script":
            with open(os.path.join(ROOT, "docs", "results", "reproduction", "run.sh")) as f:
                missing = script_covers(doc, f.read())
            if missing:
                problems.append(f"{doc.source}:{doc.line}: not what docs/results/reproduction/run.sh runs: {missing}")
    assert only or any(o.rule.name == "reproduction script" for o in outcomes.values()), "run.sh is not run"

    workers = int(os.environ.get("DELTARES_TEST_WORKERS", "2"))
    todo = sorted(outcomes.values(), key=lambda o: (not o.rule.first, -o.rule.timeout))  # the long ones early
    first = [o for o in todo if o.rule.first]
    later = [o for o in todo if not o.rule.first and reads_demo(o, paths)]
    free = [o for o in todo if not o.rule.first and not reads_demo(o, paths)]
    os.makedirs(os.path.join(ws, "logs"), exist_ok=True)
    logs = {id(o): os.path.join(ws, "logs", f"{i:02d}.log") for i, o in enumerate(todo)}
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        submit = lambda o: pool.submit(run_one, o, ws, paths, logs[id(o)])  # noqa: E731
        waiting = [submit(o) for o in first + free[:1]]
        waiting += [submit(o) for o in free[1:]]
        concurrent.futures.wait(waiting[: len(first)])
        waiting += [submit(o) for o in later]
        concurrent.futures.wait(waiting)
    wall = time.perf_counter() - start

    for o in outcomes.values():
        if o.problem:
            where = ", ".join(f"{d.source}:{d.line}" for d in o.docs)
            problems.append(f"{where} [{o.rule.name}]\n  $ {o.command}\n  {o.problem}\n  (log: {logs[id(o)]})")
    ran = [d for o in outcomes.values() for d in o.docs]
    per_source = {}
    for d in ran:
        per_source[d.source] = per_source.get(d.source, 0) + 1
    print(f"\nran {len(ran)} documented commands ({len(outcomes)} distinct runs, {wall:.0f} s on {workers} workers; "
          f"{len(not_run)} classified not to run: "
          + ", ".join(sorted({r.name for _, r in not_run})) + ")")
    print("per source: " + ", ".join(f"{s} {n}" for s, n in sorted(per_source.items())))
    for o in sorted(outcomes.values(), key=lambda o: -o.seconds)[:20]:
        print(f"  {o.seconds:6.1f} s  {o.command[:150]}")
    assert not problems, f"{len(problems)} documented commands failed:\n\n" + "\n\n".join(problems)
    assert only or len(ran) + len(not_run) >= MIN_DOCUMENTED


def test_collection_joins_continuations_keeps_loops_and_cuts_prose():
    md = (
        "Evaluate: `python -m deltares.eval --checkpoint a\n--data b`; the script `launch/tpu.sh` is a name.\n"
        "```bash\npython -m deltares.train --config x \\\n    --workdir 'y # z'   # a note\n"
        "for v in a b; do\n  python -m deltares.train --config e:$v \\\n    --workdir r/$v\ndone\n"
        "pip install x\n```\n```python\npython -m deltares.not_shell\n```\n"
    )
    assert [c for _, c in markdown_commands(md)] == [
        "python -m deltares.train --config x --workdir 'y # z'",
        "for v in a b; do python -m deltares.train --config e:$v --workdir r/$v; done",
        "python -m deltares.eval --checkpoint a --data b",
    ]
    assert markdown_snippets(md + "```text\nx = 1\n```\n```python\nimport os\n\nprint(os.sep)\n```\n") == [
        (13, "python -m deltares.not_shell\n"), (19, "import os\n\nprint(os.sep)\n")]
    doc = ("Run: python -m deltares.train --config a \\\n         --workdir b   (prose\n    more prose)\n"
           "Paper: 1.0\n    for B in 1 2; do python -m deltares.train --config c,block_layers=$B \\\n"
           "        --workdir d$B; done\n")
    assert [c for _, c in docstring_commands(doc)] == [
        "python -m deltares.train --config a --workdir b",
        "for B in 1 2; do python -m deltares.train --config c,block_layers=$B --workdir d$B; done",
    ]


def test_stand_ins_and_shortening_reach_the_command(workspace):
    _, paths = workspace
    loop = Doc("experiments/s533m.py", 1, "for B in 2 6; do python -m deltares.train --config "
               "experiments/s533m.py:delta_block,block_layers=$B --workdir runs/b$B --config.data.dataset=DATA; done")
    rule = classify(loop, paths)
    assert rule.how == "dry_run"
    assert runnable(loop, rule, paths) == (
        "for B in 2 6; do python -m deltares.train --config experiments/s533m.py:delta_block,block_layers=$B "
        f"--workdir runs/b$B --config.data.dataset={paths['demo']}/dataset --dry_run; done")
    launch = Doc("README.md", 1, "launch/tpu.sh --type v5p-8 --config experiments/s220m.py:delta ... -- --x=1")
    assert runnable(launch, classify(launch, paths), paths) == (
        f"launch/tpu.sh --dry-run --type v5p-8 --config experiments/s220m.py:delta --name my-tpu --zone us-east5-a "
        f"--workdir {paths['bucket']}/run -- --x=1")
    script_line = Doc("docs/results/reproduction/run.sh", 1, 'python -m deltares.compare "$RUNS"/a --out "$DATA"')
    assert classify(script_line, paths).how == "in_script"
    assert substitute(script_line.command, paths) == script_line.command  # $DATA is the script's own variable
    assert script_covers(Doc("x", 1, "python -m deltares.compare a --out b"), "python -m deltares.compare --out") == []
    assert script_covers(Doc("x", 1, "python -m deltares.eval --max_batches 2"), "python -m deltares.compare") == [
        "python -m deltares.eval", "--max_batches"]
    unknown = Doc("README.md", 1, "python -m deltares.new_tool --x")
    assert classify(unknown, paths) is None
