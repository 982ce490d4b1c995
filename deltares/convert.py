"""Convert checkpoints between Hugging Face Qwen3 and deltares, and between residual schemes.

    # a pretrained Qwen3 into Delta Block, as a Hugging Face directory (exact at step 0)
    python -m deltares.convert --hf /path/to/Qwen3-0.6B --mode delta_block --block_layers 4 --out qwen3_delta
    # the paper's null-source variant instead of the exact gate
    python -m deltares.convert --hf /path/to/Qwen3-0.6B --mode delta --null_source --nogate --out qwen3_null
    # a Hugging Face checkpoint into a deltares run directory (for eval, generate, init_from)
    python -m deltares.convert --hf /path/to/Qwen3-0.6B --mode delta_block --out_workdir runs/qwen3_delta
    # a trained deltares run out to Hugging Face (tokenizer from the run's dataset)
    python -m deltares.convert --checkpoint runs/ft_delta_block --out exported [--dtype bfloat16]

Tensor names and config.json fields: see `deltares.interop.hf`. Every input is checked before
anything is written. The output is written whole into `<out>.partial` beside `--out` (or
`--out_workdir`) and renamed into place only when complete, so a failure leaves what was there as it
was. An output folder that holds a model or other files is refused unless `--overwrite` is given, which
replaces it whole: nothing of the old folder is kept. A run (its own or another), a dataset, a folder
holding one, an input or a folder around one is never replaced; a link is followed (its target is
replaced, the link kept).

A run of the `bytes` tokenizer is exported with a byte-level tokenizer.json of the same ids; a run
whose tokenizer cannot be found (its `bpe:N` dataset is gone) is exported without one, with a warning
saying to pass `--tokenizer`.
"""

from __future__ import annotations

import os
import sys

import ml_collections
from absl import app, flags, logging

from deltares.common.outputs import MODEL, check_output
from deltares.data import paths
from deltares.data.dataset import TokenData
from deltares.data.documents import DataError
from deltares.data.run_data import run_dataset_path, run_tokenizer
from deltares.data.tokenizer import export_json, load_tokenizer
from deltares.interop import hf
from deltares.training.checkpoint import CheckpointError, Checkpointer, load_checkpoint
from deltares.training.experiment import base_config


def _residual_request(mode, block_layers, gate, null_source):
    if mode is None:
        if block_layers is not None or gate is not None or null_source:
            raise hf.HFError("--block_layers, --gate and --null_source need --mode")
        return None
    out = {"mode": mode, "null_source": bool(null_source)}
    if block_layers is not None:
        out["block_layers"] = block_layers
    if gate is not None:
        out["gate"] = gate
    return out


def hf_to_hf(src: str, out: str, residual=None, dtype: str = "float32") -> None:
    """A Hugging Face directory converted into another residual scheme, with the source's tokenizer."""
    cfg, params = hf.from_hf(src, residual, dtype="float32")
    template = hf.read_hf_config(src)
    has_tokenizer = os.path.exists(os.path.join(src, "tokenizer.json"))
    hf.to_hf(cfg, params, out, dtype=dtype, tokenizer=src if has_tokenizer else None, template=template)
    if not has_tokenizer:
        print(f"warning: no tokenizer.json written: {src} has none; copy the model's tokenizer into the output",
              file=sys.stderr)


def hf_to_workdir(src: str, workdir: str, residual=None) -> None:
    """A deltares run directory whose step-0 checkpoint holds the converted parameters."""
    cfg, params = hf.from_hf(src, residual, dtype="float32")
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise hf.HFError(f"{workdir} already holds checkpoints; choose a new --out_workdir")
    config = base_config()
    config.model = cfg
    config.init_from_hf = os.path.abspath(src)
    config.data.tokenizer = f"hf:{os.path.abspath(src)}"
    ckpt = Checkpointer(workdir, async_save=False)
    try:
        ckpt.save(0, {"step": 0, "params": params}, {}, config.to_dict())
        ckpt.wait()
    finally:
        ckpt.close()


def workdir_to_hf(checkpoint: str, out: str, dtype: str = "float32", tokenizer: str | None = None) -> None:
    """A Hugging Face directory of a deltares run: its parameters, and `tokenizer` (a tokenizer.json or its
    directory) or else the run's own tokenizer (a warning when that cannot be found)."""
    loaded = load_checkpoint(checkpoint)
    cfg = ml_collections.ConfigDict(loaded.config)
    hf.to_hf(cfg.model, loaded.state["params"], out, dtype=dtype, tokenizer=tokenizer)
    if tokenizer:
        return
    run_tok, where = _run_tokenizer(loaded.config, loaded.workdir)
    if run_tok is None:
        print(f"warning: no tokenizer.json written: the tokenizer of {checkpoint} ({where}) is not available; "
              f"pass --tokenizer PATH (a tokenizer.json or its folder) to export one", file=sys.stderr)
        return
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(export_json(run_tok))


def _run_tokenizer(config, workdir: str):
    """(the tokenizer a run trained with, or None; where it was looked for): its dataset's, else its spec's
    (all but `bpe:N` need no dataset)."""
    data_dir = run_dataset_path(config, workdir)
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        return TokenData(data_dir).tokenizer(), data_dir
    try:
        spec = run_tokenizer(config)
        return (None if spec.startswith("bpe:") else load_tokenizer(spec)), f"{spec}, its dataset {data_dir} is gone"
    except (DataError, FileNotFoundError, ValueError) as err:
        return None, str(err)


def convert_inputs(hf_dir: str | None, checkpoint: str | None, tokenizer: str | None) -> list[str]:
    """What a conversion reads, for deltares.common.outputs.check_output: the Hugging Face folder or the run
    (or its step folder), and the tokenizer given."""
    return [p for p in (hf_dir, checkpoint, tokenizer) if p]


def convert(*, hf_dir: str | None = None, checkpoint: str | None = None, out: str | None = None,
            out_workdir: str | None = None, residual=None, dtype: str = "float32", tokenizer: str | None = None,
            overwrite: bool = False) -> str:
    """One conversion of the command line (see the module docstring): where it may write is checked first
    (deltares.common.outputs: never onto or around an input, a run, a dataset; a model only with
    `overwrite`); returns the folder written."""
    inputs = convert_inputs(hf_dir, checkpoint, tokenizer)
    if out:
        target = check_output(out, writes="folder", inputs=inputs, replaces=(MODEL,))
        if checkpoint:
            paths.write_whole(target, lambda o: workdir_to_hf(checkpoint, o, dtype, tokenizer), overwrite=overwrite,
                              shown=out)
        else:
            paths.write_whole(target, lambda o: hf_to_hf(hf_dir, o, residual, dtype), overwrite=overwrite, shown=out)
        return out
    target = check_output(out_workdir, writes="folder", inputs=inputs, flag="--out_workdir")
    paths.write_whole(target, lambda o: hf_to_workdir(hf_dir, o, residual), overwrite=overwrite,
                      flag="--out_workdir", shown=out_workdir)
    return out_workdir


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if bool(_HF.value) == bool(_CHECKPOINT.value):
        raise app.UsageError("give exactly one of --hf (a Hugging Face directory) or --checkpoint (a deltares run)")
    if bool(_OUT.value) == bool(_OUT_WORKDIR.value):
        raise app.UsageError("give exactly one of --out (a Hugging Face directory) or --out_workdir (a deltares run)")
    if _CHECKPOINT.value and (_OUT_WORKDIR.value or _MODE.value):
        raise app.UsageError("--checkpoint exports to --out as stored; --mode and --out_workdir need --hf")
    try:
        residual = None if _CHECKPOINT.value else _residual_request(_MODE.value, _BLOCK_LAYERS.value, _GATE.value,
                                                                     _NULL_SOURCE.value)
        written = convert(hf_dir=_HF.value, checkpoint=_CHECKPOINT.value, out=_OUT.value, out_workdir=_OUT_WORKDIR.value,
                          residual=residual, dtype=_DTYPE.value, tokenizer=_TOKENIZER.value, overwrite=_OVERWRITE.value)
    except (hf.HFError, FileNotFoundError, FileExistsError, ValueError, CheckpointError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {written}" + ("/checkpoints/0" if _OUT_WORKDIR.value else ""))


def cli() -> None:
    """The command line (`python -m deltares.convert`, `deltares-convert`); flags only here, so modules
    import side by side."""
    global _HF, _CHECKPOINT, _OUT, _OUT_WORKDIR, _MODE, _BLOCK_LAYERS, _GATE, _NULL_SOURCE, _DTYPE, _TOKENIZER
    global _OVERWRITE
    from deltares import command_line
    from deltares.common.domains import AT_LEAST_1, define_number

    _HF = flags.DEFINE_string("hf", None, "A Hugging Face Qwen3 checkpoint directory to read.")
    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A deltares run directory (or step directory) to export.")
    _OUT = flags.DEFINE_string("out", None, "The Hugging Face directory to write.")
    _OUT_WORKDIR = flags.DEFINE_string("out_workdir", None, "A new deltares run directory to write (with --hf).")
    _MODE = flags.DEFINE_enum("mode", None, list(hf.MODES), "Residual scheme to convert into (default: as stored).")
    _BLOCK_LAYERS = define_number(flags.DEFINE_integer, "block_layers", None,
                                               "Layers per block for the block modes.", AT_LEAST_1)
    _GATE = flags.DEFINE_bool("gate", None, "Zero gate on the routed term (exact conversion; default on for delta modes).")
    _NULL_SOURCE = flags.DEFINE_bool("null_source", False, "Add the paper's learned null source to every routing.")
    _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of the written tensors.")
    _TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json (or its directory) to write with --checkpoint.")
    _OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out or --out_workdir whole (the new "
                                   "output is written beside it and swapped in when complete); never an input, a "
                                   "run, a dataset or a folder holding one.")
    command_line.run(main)


if __name__ == "__main__":
    cli()
