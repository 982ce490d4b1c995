"""Experiment configs: every `experiments/<scale>.py` builds for every mode, the paper scales
have the sizes of docs/guides/training.md ("Experiments and variants"), and variant strings parse
(or fail) as documented."""

import importlib.util
import math
import os
import re

import flax
import jax
import jax.numpy as jnp
import pytest

from deltares.common.domains import Domain
from deltares.training.experiment import parse_variant
from deltares.nn.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALES = ["debug", "tiny", "s220m", "s533m", "s1044m", "qwen3_0p6b", "s7b6"]
MODES = ["baseline", "full_attnres", "block_attnres", "delta", "delta_block", "hyper", "mhc", "denseformer"]
ROUTING_MODES = MODES[:5]

# docs/guides/training.md, "Experiments and variants": (d, L, heads, kv, head_dim, ffn, params in millions;
# vocab 151936, tied).
DESIGN_TABLE = {
    "s220m": (768, 12, 12, 4, 64, 3072, 220.5),
    "s533m": (1024, 24, 16, 8, 64, 4096, 533.1),
    "s1044m": (1280, 36, 20, 4, 64, 5120, 1043.9),
    "qwen3_0p6b": (1024, 28, 16, 8, 128, 3072, 596.0),
    "s7b6": (4096, 36, 32, 8, 128, 12288, 7568.4),
}


def load(scale):
    path = os.path.join(ROOT, "experiments", f"{scale}.py")
    spec = importlib.util.spec_from_file_location(f"experiments_{scale}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def param_shapes(model_cfg):
    shapes = jax.eval_shape(Transformer(model_cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    return flax.linen.meta.unbox(shapes)["params"]


def count(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def expected_count(m, mode):
    """Qwen3 parameter count from the architecture alone (no model code)."""
    d, L, N, K, H, F, V = m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    per_layer = d * N * H + 2 * d * K * H + N * H * d  # q, k, v, o
    per_layer += 3 * d * F  # gate, up, down
    per_layer += 2 * d + 2 * H  # attn/mlp pre-norms, q/k head norms
    total = V * d + L * per_layer + d  # embedding (tied head) and final norm
    if not m.tie_embeddings:
        total += V * d
    n = m.residual.streams
    if mode == "hyper":  # per sublayer: static read, write [n] and mixing [n, n]; dynamic W [d], [d, n], [d], 2 scales
        total += 2 * L * (2 * n + n * n + (d * (n + 2) + 2 if m.residual.dynamic else 0))
    elif mode == "mhc":  # per sublayer: phi [n d, n (n + 2)], 3 scales, biases [n (n + 2)]
        total += 2 * L * (n * d * n * (n + 2) + 3 + n * (n + 2))
    elif mode == "denseformer":  # per layer: weights over the L + 1 layer outputs
        total += L * (L + 1)
    elif mode != "baseline":
        total += L * 4 * d  # (w, g) per sublayer
    if mode in ("full_attnres", "block_attnres"):
        total += 2 * d  # final router
    return total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", SCALES)
def test_every_experiment_builds(scale, mode):
    cfg = load(scale).get_config(mode)
    assert cfg.model.residual.mode == mode
    params = param_shapes(cfg.model)
    assert count(params) == expected_count(cfg.model, mode)
    assert params["embed"]["embedding"].shape == (cfg.model.vocab_size, cfg.model.d_model)
    if cfg.model.scan_layers:
        assert params["layers"]["attn"]["q_proj"]["kernel"].shape[0] == cfg.model.n_layers


@pytest.mark.parametrize("scale", sorted(DESIGN_TABLE))
def test_paper_scales_match_design_table(scale):
    d, L, N, K, H, F, millions = DESIGN_TABLE[scale]
    for mode in ROUTING_MODES:  # the mixing modes' parameters: test_every_experiment_builds
        m = load(scale).get_config(mode).model
        assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff) == (d, L, N, K, H, F)
        assert m.vocab_size == 151936 and m.tie_embeddings
        n = expected_count(m, mode) / 1e6  # the built model's count: test_every_experiment_builds
        assert abs(n - millions) / millions < 0.005, f"{scale} {mode}: {n:.1f}M vs {millions}M"
        if mode == "baseline":  # the table's figure is the baseline model, to its printed precision
            assert abs(n - millions) < 0.05 + 1e-9, f"{scale}: {n:.2f}M vs {millions}M"


@pytest.mark.parametrize("scale", SCALES)
def test_default_variant_and_documented_block_size(scale):
    module = load(scale)
    cfg = module.get_config()
    assert cfg.model.residual.mode == "delta_block"
    assert cfg.model.residual.include_partial is True
    match = re.search(r"(\d+) layers per block", module.__doc__ or "")
    if match:  # the docstring promises the default block size
        assert cfg.model.residual.block_layers == int(match.group(1))
    assert 1 <= cfg.model.residual.block_layers <= cfg.model.n_layers


GROUPED_SCALES = ("s533m", "s1044m", "qwen3_0p6b")  # the remat scales measured grouped (experiment.py)


@pytest.mark.parametrize("scale", SCALES)
def test_per_sublayer_modes_route_two_phase_at_the_remat_scales(scale):
    """`delta` and `full_attnres` default to two-phase groups (of 6 layers at s1044m, unrolled; of 4
    at s533m and qwen3_0p6b) and train two-phase there; the block modes, baseline and the other
    scales do not; the command line can still turn it off."""
    from deltares.nn.residual import two_phase

    for mode in MODES:
        model = load(scale).get_config(mode).model
        grouped = scale in GROUPED_SCALES and mode in ("delta", "full_attnres")
        assert model.residual.group_layers == ((6 if scale == "s1044m" else 4) if grouped else 0), (scale, mode)
        assert two_phase(model) == grouped, (scale, mode)
    if scale in GROUPED_SCALES:
        cfg = parse_flags(f"--config={ROOT}/experiments/{scale}.py:delta", "--config.model.residual.group_layers=0")
        assert cfg.model.residual.group_layers == 0


def test_measured_scales_unroll_their_layers():
    """The paper's scales up to 1044M and qwen3_0p6b unroll their layers in every mode, two-phase
    groups included: each router reads only its own sources (faster by the TPU estimate,
    experiments' docstrings); 7.6B keeps the scan (its store-once pass fits the memory goals)."""
    for scale in ("s220m", "s533m", "s1044m", "qwen3_0p6b", "finetune_qwen3_0p6b"):
        for mode in MODES:
            assert load(scale).get_config(mode).model.scan_layers is False, (scale, mode)
    assert load("s7b6").get_config("delta").model.scan_layers is True


def test_variant_sets_block_layers():
    assert parse_variant("delta_block,block_layers=4") == {"mode": "delta_block", "block_layers": 4}
    for scale in ("s220m", "tiny", "s7b6"):
        cfg = load(scale).get_config("delta_block,block_layers=4")
        assert cfg.model.residual.mode == "delta_block"
        assert cfg.model.residual.block_layers == 4
    cfg = load("s220m").get_config(" block_attnres , block_layers = 3 ")
    assert (cfg.model.residual.mode, cfg.model.residual.block_layers) == ("block_attnres", 3)


@pytest.mark.parametrize(
    "arg,expected",
    [
        ("delta", {"mode": "delta"}),
        ("baseline", {"mode": "baseline"}),
        ("", {"mode": "delta_block"}),
        (None, {"mode": "delta_block"}),
        ("block_layers=6", {"mode": "delta_block", "block_layers": 6}),
        ("full_attnres,include_partial=false", {"mode": "full_attnres", "include_partial": False}),
        ("delta_block,include_partial=True,block_layers=1",
         {"mode": "delta_block", "include_partial": True, "block_layers": 1}),
    ],
)
def test_parse_variant(arg, expected):
    assert parse_variant(arg) == expected


def test_include_partial_variant_reaches_model():
    cfg = load("debug").get_config("block_attnres,include_partial=false")
    assert cfg.model.residual.include_partial is False
    # include_partial changes which sources are read, not which parameters exist.
    assert count(param_shapes(cfg.model)) == expected_count(cfg.model, "block_attnres")


@pytest.mark.parametrize(
    "arg,problem",
    [
        ("deltablock", "deltablock"),
        ("Delta", "Delta"),
        ("delta_block,block_size=4", "block_size"),
        ("delta_block,4", "4"),
        ("delta_block,block_layers=four", "block_layers"),
        ("delta_block,include_partial=maybe", "include_partial"),
        ("delta_block,block_layers=0", "block_layers"),
        ("delta_block,block_layers=-2", "block_layers"),
        ("delta_block,block_layers=13", "block_layers"),  # s220m has 12 layers
        ("block_attnres,block_layers=100", "block_layers"),
    ],
)
def test_bad_variants_raise(arg, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        load("s220m").get_config(arg)


@pytest.mark.parametrize(
    "arg,problem",
    [("deltablock", "deltablock"), ("delta_block,foo=1", "foo"), ("delta_block,=3", "="),
     ("delta_block,include_partial=2", "include_partial"), ("delta_block,block_layers=2.5", "block_layers")],
)
def test_parse_variant_rejects_bad_arguments_itself(arg, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_variant(arg)


def test_block_layers_equal_to_depth_is_allowed():
    cfg = load("s220m").get_config("delta_block,block_layers=12")
    assert cfg.model.residual.block_layers == 12
    with pytest.raises(ValueError, match="block_layers"):
        load("debug").get_config("delta_block,block_layers=4")  # debug has 3 layers


@pytest.mark.parametrize("scale", ["s220m", "s533m"])
def test_block_size_ablation_variants(scale):
    module = load(scale)
    expected = {"s220m": (1, 2, 4, 6, 12), "s533m": (2, 6, 12, 24)}[scale]
    assert tuple(module.ABLATION_BLOCK_LAYERS) == expected
    for block_layers in expected:
        cfg = module.get_config(f"delta_block,block_layers={block_layers}")
        assert cfg.model.residual.block_layers == block_layers
        assert cfg.train.steps == 10_000 and cfg.data.seq_len == 2048


# ----------------------------------------------------------------------------- command line

EXPERIMENTS = SCALES + ["finetune_qwen3_0p6b"]


def parse_flags(*argv):
    """`config` as `deltares.train` parses it (ml_collections' config_flags, fresh absl flags)."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["train", *argv]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", EXPERIMENTS)
def test_unset_fields_override_from_the_command_line(scale, mode):
    path = os.path.join(ROOT, "experiments", f"{scale}.py:{mode}")
    cfg = parse_flags("--config", path, "--config.data.dataset=data/fineweb", "--config.optim.routing_lr=1e-2")
    assert cfg.data.dataset == "data/fineweb"
    assert cfg.optim.routing_lr == 1e-2 and isinstance(cfg.optim.routing_lr, float)
    default = parse_flags("--config", path)
    paper = scale in DESIGN_TABLE
    assert default.data.dataset == (None if paper else "builtin"), "paper scales leave the dataset unset"
    assert default.optim.routing_lr == (5e-3 if scale.startswith("finetune") else None)
    with pytest.raises(Exception, match="routing_lr"):
        parse_flags("--config", path, "--config.optim.routing_lr=fast")


def test_unset_routing_lr_means_the_model_lr():
    import numpy as np

    from deltares.training.optim import make_optimizer

    params = {"attn_router": {"query": np.zeros(4, np.float32)}, "w": np.zeros((4, 4), np.float32)}
    for routing_lr, expected in ((None, 3e-3), (1e-2, 1e-2)):
        cfg = load("debug").get_config("delta_block")
        if routing_lr is not None:
            cfg.optim.routing_lr = routing_lr
        _, schedules = make_optimizer(cfg, params)
        warm = cfg.optim.warmup_steps
        assert float(schedules["model"](warm)) == pytest.approx(3e-3)
        assert float(schedules["routing"](warm)) == pytest.approx(expected)


def test_unset_dataset_is_one_clear_error():
    from deltares.train import TrainError, check_train_config

    cfg = load("s220m").get_config("delta")
    with pytest.raises(TrainError, match=r"config\.data\.dataset is not set.*--config\.data\.dataset=DIR"):
        check_train_config(cfg)
    cfg.data.dataset = "data/fineweb"
    check_train_config(cfg)


# ----------------------------------------------------------------------------- --dry_run


def test_dry_run_of_7b6_is_abstract_and_counts_right():
    from deltares.train import dry_run

    cfg = load("s7b6").get_config("delta_block")
    cfg.data.dataset = "/nonexistent/fineweb"  # never read
    r = dry_run(cfg)
    n = expected_count(cfg.model, "delta_block")
    assert r["params"] == n
    assert r["tokens_per_step"] == 64 * 2048
    # float32 parameters and AdamW's two moments, plus a few scalars (step, Adam's counts)
    assert 12 * n <= r["state_bytes"] <= 12 * n + 1024
    assert r["state_bytes_per_device"] == r["state_bytes"] or jax.device_count() > 1
    assert r["outputs"] == {"grad_norm": "float32[]", "loss": "float32[]", "max_token": "int32[]"}


def test_dry_run_command_reads_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    from tests.jax_cache import ENV

    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "deltares.train", "--config", "experiments/s1044m.py:delta", "--workdir", str(workdir),
         "--config.data.dataset", str(tmp_path / "missing"), "--config.optim.routing_lr=1e-2", "--dry_run"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dry run of s1044m delta: config valid" in proc.stdout
    assert f"{expected_count(load('s1044m').get_config('delta').model, 'delta'):,} parameters" in proc.stdout
    assert "32 x 2048 = 65,536 tokens" in proc.stdout
    assert not workdir.exists() and not (tmp_path / "missing").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "deltares.train", "--config", "experiments/s1044m.py:delta", "--dry_run",
         "--config.data.dataset=x", "--config.model.n_kv_heads=3"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
        "error: config.model.n_kv_heads=3 is invalid: must divide n_heads=20")


# ----------------------------------------------------------------------------- the schema


def _all_fields():
    from deltares.nn.config import MODEL_FIELDS
    from deltares.training.experiment import BASE_FIELDS

    return [("config." + f.name, f) for f in BASE_FIELDS] + [("config.model." + f.name, f) for f in MODEL_FIELDS]


def _full_config():
    from deltares.nn.config import model_config
    from deltares.training.experiment import base_config

    cfg = base_config()
    cfg.model = model_config()
    return cfg


def _at(tree, dotted):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def test_every_schema_field_is_built_with_its_default():
    from ml_collections.config_dict import FieldReference

    cfg = _full_config()
    for name, field in _all_fields():
        value = _at(cfg, name[len("config."):])
        assert value == field.default, name
        if field.default is None:  # an unset field is a typed placeholder, overridable by --config.x.y=
            section, key = name[len("config."):].rsplit(".", 1)
            ref = _at(cfg, section).get_ref(key)
            assert isinstance(ref, FieldReference) and ref.get_type() is field.type, name
    from deltares.training.experiment import describe_config

    listing = describe_config()
    assert all(f"| {name} |" in listing for name, _ in _all_fields())


WRONG_TYPE = {bool: 1, int: "8", float: "fast", str: 3, tuple: 5}


@pytest.mark.parametrize("name", [n for n, _ in _all_fields()])
def test_wrong_type_or_disallowed_value_names_the_field(name):
    import ml_collections

    from deltares.training.experiment import validate_config

    fields = dict(_all_fields())
    field = fields[name]
    bad_values = [WRONG_TYPE[field.type]]
    if isinstance(field.allowed, tuple):
        bad_values.append("not_" + str(field.allowed[0]))
    elif isinstance(field.allowed, Domain):  # every probe outside the range (tests/test_domains.py walks more)
        probes = (-1, 0, 10**30) if field.type is int else (-1.0, 0.0, math.nan, math.inf)
        bad_values += [v for v in probes if field.allowed.problem(v)]
        assert bad_values[1:], f"{name}: no probe outside {field.allowed}"
    for bad in bad_values:
        tree = _full_config().to_dict()
        *sections, key = name[len("config."):].split(".")
        (_at(tree, ".".join(sections)) if sections else tree)[key] = bad
        with pytest.raises(ValueError, match=re.escape(name) + "="):
            validate_config(ml_collections.ConfigDict(tree))
    validate_config(_full_config())


def test_old_saved_config_missing_new_fields_loads(tmp_path):
    import ml_collections
    import orbax.checkpoint as ocp

    from deltares.training.checkpoint import load_checkpoint
    from deltares.training.experiment import validate_config, with_schema_defaults

    saved = load("debug").get_config("delta_block").to_dict()
    for section, key in (("model.residual", "impl"), ("model.residual", "gate"), ("model.residual", "null_source"),
                         ("model.residual", "interpret"), ("train", "wandb"), ("train", "profile_steps"),
                         ("optim", "routing_lr"), ("", "init_from_hf")):
        del (_at(saved, section) if section else saved)[key]
    with pytest.raises(ValueError, match=r"config\.init_from_hf is missing"):
        validate_config(ml_collections.ConfigDict(saved))
    filled = with_schema_defaults(saved)
    assert filled["model"]["residual"]["impl"] == "auto" and filled["train"]["wandb"]["project"] == ""
    assert filled["model"]["residual"]["block_layers"] == saved["model"]["residual"]["block_layers"]
    cfg = ml_collections.ConfigDict(filled)
    validate_config(cfg)
    Transformer(cfg.model)
    step_dir = tmp_path / "checkpoints" / "7"  # the load path fills the same way
    (step_dir / "state").mkdir(parents=True)
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(step_dir / "config", args=ocp.args.JsonSave(saved))
    loaded = load_checkpoint(str(step_dir), want_state=False)
    assert loaded.step == 7 and loaded.config == filled


@pytest.mark.parametrize("scale", EXPERIMENTS)
def test_every_experiment_satisfies_the_schema(scale):
    from deltares.train import TrainError, check_train_config

    for mode in MODES:
        cfg = load(scale).get_config(mode)
        cfg.data.dataset = cfg.data.dataset or "data/fineweb"
        check_train_config(cfg)
    cfg.train.eval_every = 0
    with pytest.raises(TrainError, match=r"config\.train\.eval_every=0"):
        check_train_config(cfg)
