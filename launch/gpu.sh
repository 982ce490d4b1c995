#!/usr/bin/env bash
# Train deltares on the NVIDIA GPUs of one node, all of them in one process (the default
# mesh, FSDP over every device, spans them): create (or reuse) a virtual environment,
# install the requirements plus the CUDA build of the pinned jax, check that JAX sees the
# GPUs, train. See launch/README.md.
#
#   launch/gpu.sh --config experiments/s220m.py:delta_block --workdir runs/x [-- --config.key=value ...]
set -euo pipefail

src=${BASH_SOURCE[0]}
[[ $src == */* ]] || src=./$src
ROOT=$(cd "${src%/*}/.." && pwd)
CONFIG=${DELTARES_CONFIG:-}
WORKDIR=${DELTARES_WORKDIR:-}
VENV=${DELTARES_VENV:-$ROOT/.venv}
PYTHON=${DELTARES_PYTHON:-python3}
CUDA=${DELTARES_CUDA:-12}
GPUS=${DELTARES_GPUS:-all}
INSTALL=1 DRY=0 EXTRA=()

usage() {
  cat <<'EOF'
Usage: launch/gpu.sh [options] [-- train overrides...]
  --config FILE:MODE e.g. experiments/s220m.py:delta_block (env DELTARES_CONFIG)  required
  --workdir DIR      run directory (env DELTARES_WORKDIR)                          required
  --venv DIR         virtual environment to create/reuse (env DELTARES_VENV; default the checkout's .venv)
  --python PY        Python >= 3.11 that creates the venv (env DELTARES_PYTHON; default python3)
  --cuda 12|13       CUDA major version of the jax build (env DELTARES_CUDA; default 12)
  --gpus all|N|IDS   the GPUs to train on: all (default), the first N, or a list of IDs such as
                     0,2 or 3, (sets CUDA_VISIBLE_DEVICES; env DELTARES_GPUS)
  --skip-install     reuse the venv as it is
  --dry-run          print every command instead of running it
A relative path is taken from the current directory; `~` is expanded.
Everything after `--` is passed to `python -m deltares.train` (but --config and --workdir).
EOF
}
PROG=gpu.sh
# shellcheck source=launch/common.sh
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

while (($#)); do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    --config | --workdir | --venv | --python | --cuda | --gpus)
      (($# >= 2)) || die "$opt needs a value"
      var=${opt#--}
      printf -v "${var^^}" '%s' "$2" # --cuda 13  ->  CUDA=13
      shift 2 ;;
    --skip-install) INSTALL=0; shift ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument '$opt' (see --help; train overrides go after --)" ;;
  esac
done

missing=()
[[ -n $CONFIG ]] || missing+=(--config)
[[ -n $WORKDIR ]] || missing+=(--workdir)
((${#missing[@]} == 0)) || die "missing required setting: ${missing[*]} (flag or DELTARES_* env var, see --help)"
refuse_set_flags "give it before --" config workdir -- "${EXTRA[@]}"
local_path WORKDIR --workdir
local_path VENV --venv
[[ $CUDA == 12 || $CUDA == 13 ]] || die "--cuda must be 12 or 13, not '$CUDA'"
env=(env) count=0 # count: the GPUs JAX must see (0: any number)
if [[ $GPUS =~ ^[1-9][0-9]*$ ]]; then
  ((${#GPUS} <= 3 && GPUS <= 256)) || die "--gpus $GPUS: a node has at most 256 GPUs here; give a number from 1 to 256"
  count=$GPUS
  env+=("CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((GPUS - 1)))")
elif [[ $GPUS =~ ^[0-9]+(,[0-9]+)*,?$ && $GPUS == *,* ]]; then
  IFS=, read -ra ids <<<"$GPUS"
  count=${#ids[@]}
  env+=("CUDA_VISIBLE_DEVICES=${GPUS%,}")
elif [[ $GPUS != all ]]; then
  die "--gpus must be all, a number of GPUs or a list of IDs (0,2; one ID: 3,), not '$GPUS'"
fi
check_config_and_jax_pin
py=$VENV/bin/python
cd "$ROOT" # every path above is absolute or relative to the checkout (local_path)
((!DRY)) || echo "+ $(quote cd "$ROOT")"

if ((INSTALL)); then
  if [[ ! -x $py ]]; then
    ((DRY)) || command -v "$PYTHON" >/dev/null || die "$PYTHON not found on PATH (pass --python)"
    run "$PYTHON" -m venv "$VENV"
  fi
  if ((!DRY)) && ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    die "$VENV uses Python < 3.11 (jax $JAX_VERSION needs >= 3.11); pass --python python3.11 and a new --venv"
  fi
  run "$py" -m pip install -q -U pip
  run "$py" -m pip install -q -r requirements.txt
  run "$py" -m pip install -q "jax[cuda$CUDA]==$JAX_VERSION"
elif ((!DRY)) && [[ ! -x $py ]]; then
  die "--skip-install but $VENV has no bin/python"
fi

check='import jax, sys; d, n = jax.devices(), int(sys.argv[1]); print("jax", jax.__version__, len(d), "devices:", d); sys.exit("gpu.sh: error: JAX sees no GPU (driver? --cuda 12/13?)" if d[0].platform != "gpu" else n and len(d) != n and f"gpu.sh: error: JAX sees {len(d)} GPUs, not the {n} of --gpus")'
run "${env[@]}" "$py" -c "$check" "$count"
train=("${env[@]}" "$py" -m deltares.train --config "$CONFIG" --workdir "$WORKDIR" "${EXTRA[@]}")
if ((DRY)); then run "${train[@]}"; else exec "${train[@]}"; fi
