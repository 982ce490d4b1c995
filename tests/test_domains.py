"""Every argument's domain (issue 41): every numeric flag of every command and every numeric config
field, walked with 0, -1, nan, inf and a huge value, is either refused in one `error:` line naming it
and its range, or accepted and inside that range; never a traceback, never a value outside its range
let through. The walks run in this process: the commands' flag parsing (`command_line._parse_flags`,
which checks each flag's range) and `validate_config` are what run before any work. A few command
lines then prove the real path end to end (tests/faults.py runs the same ones as its fault table)."""

import math
import os
import tomllib

import pytest
from absl import flags

from debug_runs import assert_each_fails_cleanly, debug_config, tree_digest
from deltares import command_line
from deltares.common.domains import INT_LIMIT, Domain
from deltares.nn.config import MODEL_FIELDS
from deltares.training.experiment import BASE_FIELDS, validate_config
from jax_cache import ROOT

INT_PROBES = ("0", "-1", "nan", "inf", "1e30", str(10**30))
FLOAT_PROBES = ("0", "-1", "nan", "inf", "1e30")


def absl_commands() -> list[str]:
    """The modules of the console scripts (pyproject.toml) whose command line is absl's (`cli`);
    `deltares.harness` is lm-eval's own."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    return sorted(target.split(":")[0] for target in scripts.values() if target.endswith(":cli"))


def numeric_flags(names) -> dict:
    """{name: Flag} of the integer and float flags among `names` of absl's FLAGS."""
    chosen = {}
    for name in names:
        flag = flags.FLAGS[name]
        if isinstance(flag.parser, (flags.IntegerParser, flags.FloatParser)):
            chosen[name] = flag
    return chosen


@pytest.fixture
def command_flags(monkeypatch):
    """`define(module)`: the flags that module's `cli` defines (its `main` is not run), removed again after."""
    defined = []

    def define(module_name):
        module = __import__(module_name, fromlist=["cli"])
        before = set(flags.FLAGS)
        monkeypatch.setattr(command_line, "run", lambda main, **kwargs: None)
        module.cli()
        new = sorted(set(flags.FLAGS) - before)
        defined.extend(new)
        return new

    yield define
    for name in defined:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()


def parse(argv) -> str | None:
    """The `error:` line of parsing `argv` as a command does (None: accepted), from a clean slate."""
    flags.FLAGS.unparse_flags()
    try:
        command_line._parse_flags(argv)
    except SystemExit as err:
        return str(err.code)
    return None


def in_range(value, domain: Domain) -> bool:
    """Whether an accepted `value` is a number the command can work with: finite, 32-bit, in `domain`."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if isinstance(value, int) and abs(value) > INT_LIMIT:
        return False
    return domain.problem(value) is None


@pytest.mark.parametrize("module", absl_commands())
def test_every_numeric_flag_refuses_values_outside_its_range_in_one_line(module, command_flags):
    numeric = numeric_flags(command_flags(module))
    listed = {f.name for f in flags.FLAGS.get_flags_for_module(module)}
    failures = [f"--{name}: not the command's own flag (its --help leaves it out)" for name in set(numeric) - listed]
    for name, flag in numeric.items():
        domain = getattr(flag, "domain", None)
        if not isinstance(domain, Domain):
            failures.append(f"--{name}: no range declared (define_number)")
            continue
        probes = INT_PROBES if isinstance(flag.parser, flags.IntegerParser) else FLOAT_PROBES
        refused = 0
        for text in probes:
            line = parse([module, f"--{name}={text}"])
            if line is None:
                value = flags.FLAGS[name].value
                if not in_range(value, domain):
                    failures.append(f"--{name}={text}: accepted as {value!r}, outside {domain}")
                continue
            refused += 1
            if not (line.startswith("error: ") and "\n" not in line and f"--{name}=" in line):
                failures.append(f"--{name}={text}: not one error line naming the flag: {line!r}")
            try:
                number = flag.parser.parse(text)
            except ValueError:
                continue  # not a number of the flag's type: absl's own line
            if str(domain) not in line and number is not None:
                failures.append(f"--{name}={text}: the line does not name the range {domain}: {line!r}")
        if not refused:
            failures.append(f"--{name}: every probe accepted; the range {domain} bounds nothing")
    assert not failures, "\n".join(failures)
    assert parse([module]) is None  # the defaults are in range


def test_several_flags_out_of_range_are_one_line_naming_the_first(command_flags):
    command_flags("deltares.generate")
    line = parse(["deltares.generate", "--top_p=0", "--temperature=nan"])
    assert line.startswith("error: flag --temperature=nan: must be finite and non-negative") and "\n" not in line


def test_experiment_files_that_cannot_be_loaded_are_one_line_naming_them(command_flags, tmp_path):
    command_flags("deltares.train")
    (tmp_path / "syntax.py").write_text("def get_config(:\n")
    (tmp_path / "raises.py").write_text("def get_config():\n    return 1 / 0\n")
    debug = os.path.join(ROOT, "experiments", "debug.py")
    cases = {str(tmp_path / "nope.py"): "nope.py: no such file", str(tmp_path): "is a folder",
             str(tmp_path / "syntax.py"): "syntax.py line 1: invalid syntax",
             str(tmp_path / "raises.py"): "raises.py: get_config failed: ZeroDivisionError: division by zero",
             debug + ":deltaa": "unknown residual mode 'deltaa'", ":delta": "--config names no experiment file"}
    for config, words in cases.items():
        line = parse(["deltares.train", "--config", config, "--workdir", str(tmp_path / "run")])
        assert line and line.startswith("error: ") and "\n" not in line and words in line, (config, line)


def numeric_fields():
    return [(f"config.{f.name}", f) for f in BASE_FIELDS] + [(f"config.model.{f.name}", f) for f in MODEL_FIELDS]


def test_every_numeric_config_field_refuses_values_outside_its_range():
    failures = []
    for name, field in numeric_fields():
        if field.type not in (int, float):
            continue
        if not isinstance(field.allowed, Domain):
            failures.append(f"{name}: no range declared (Field.allowed)")
            continue
        probes = (0, -1, 10**30) if field.type is int else (0.0, -1.0, math.nan, math.inf, 1e30)
        for value in probes:
            cfg = debug_config()
            *sections, key = name[len("config."):].split(".")
            node = cfg
            for section in sections:
                node = node[section]
            node[key] = value
            try:
                validate_config(cfg)
            except ValueError as err:
                line = str(err)
                if "\n" in line or not line.startswith("config."):
                    failures.append(f"{name}={value}: not one line naming a field: {line!r}")
                elif not in_range(value, field.allowed) and not (f"{name}=" in line and str(field.allowed) in line):
                    failures.append(f"{name}={value}: the line names neither the field nor its range: {line!r}")
                continue
            except Exception as err:  # noqa: BLE001 - the failure this test is for
                failures.append(f"{name}={value}: {type(err).__name__}: {err}")
                continue
            if not in_range(value, field.allowed):
                failures.append(f"{name}={value}: accepted, outside {field.allowed}")
    assert not failures, "\n".join(failures)


def test_domain_words():
    assert [str(d) for d in (Domain(0, low_open=True), Domain(0), Domain(1), Domain(0, 1, low_open=True),
                             Domain(0, 1, high_open=True), Domain(1, also=(-1,)))] == [
        "positive", "non-negative", "at least 1", "in (0, 1]", "in [0, 1)", "at least 1, or -1"]
    assert Domain(1, also=(-1,)).problem(-1) is None and Domain(1, also=(-1,)).problem(0) == "must be at least 1, or -1"
    assert Domain(0).problem(math.nan) == "must be finite and non-negative"
    assert Domain(0).problem(2**31) == "must be a 32-bit integer (at most 2147483647 in size), non-negative"


# ----------------------------------------------------------------------------- end to end


def bad_arguments(tmp_path):
    """(name, command, words the error line must hold, extra environment): arguments outside their
    domains and experiment files that cannot be loaded, each refused before any work."""
    debug = os.path.join(ROOT, "experiments", "debug.py")
    syntax_error = tmp_path / "syntax_error.py"
    syntax_error.write_text("def get_config(:\n    pass\n")
    new = tmp_path / "new_run"
    train_new = ["deltares.train", "--config", debug, "--workdir", str(new)]
    eval_any = ["deltares.eval", "--checkpoint", str(tmp_path / "none"), "--data", str(tmp_path / "none")]
    generate_any = ["deltares.generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "hi"]
    return [
        ("eval --batch -1", [*eval_any, "--batch", "-1"], ["--batch=-1", "at least 1"], {}),
        ("eval --batch 0", [*eval_any, "--batch", "0"], ["--batch=0", "at least 1"], {}),
        ("eval --max_batches -1", [*eval_any, "--max_batches", "-1"], ["--max_batches=-1", "at least 1"], {}),
        ("generate --top_p 0", [*generate_any, "--top_p", "0"], ["--top_p=0", "in (0, 1]"], {}),
        ("generate --temperature -1", [*generate_any, "--temperature", "-1"], ["--temperature=-1", "non-negative"],
         {}),
        ("generate --top_k -1", [*generate_any, "--top_k", "-1"], ["--top_k=-1", "non-negative"], {}),
        ("missing experiment file", ["deltares.train", "--config", str(tmp_path / "nope.py"), "--workdir", str(new)],
         ["nope.py", "no such file"], {}),
        ("experiment file with a syntax error", ["deltares.train", "--config", str(syntax_error), "--workdir",
                                                 str(new)], ["syntax_error.py line 1", "invalid syntax"], {}),
        ("mixture weight inf", [*train_new, "--config.data.mixture=a=inf,b=1"],
         ["config.data.mixture", "'a=inf'", "finite and positive"], {}),
        ("learning rate nan", [*train_new, "--config.optim.lr=nan"], ["config.optim.lr=nan", "finite"], {}),
        ("AdamW beta2 of 1 (aot)", ["deltares.aot", "--config", debug, "--topology", "v5e:2x2",
                                    "--config.optim.b2=1"], ["config.optim.b2=1.0", "in [0, 1)"], {}),
        ("aot: batch that does not split over the slice", ["deltares.aot", "--config", debug, "--topology",
                                                            "v5e:2x2", "--config.train.global_batch=3"],
         ["global_batch=3 does not split over data x fsdp = 4"], {}),
    ]


def test_arguments_outside_their_domains_fail_with_one_line_and_write_nothing(tmp_path):
    cases = bad_arguments(tmp_path)
    before = tree_digest(tmp_path)
    assert_each_fails_cleanly(cases)
    assert tree_digest(tmp_path) == before and not (tmp_path / "new_run").exists()
