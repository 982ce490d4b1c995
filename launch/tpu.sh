#!/usr/bin/env bash
# Train deltares on a Cloud TPU VM or pod slice: create (or reuse) it, copy this working
# tree to every worker, install the requirements plus jax[tpu], start the same training
# command on all workers. See launch/README.md.
#
#   launch/tpu.sh --name NAME --zone ZONE --type v5p-16 \
#       --config experiments/s7b6.py:delta_block --workdir gs://BUCKET/run [-- --config.key=value ...]
set -euo pipefail

src=${BASH_SOURCE[0]}
[[ $src == */* ]] || src=./$src
ROOT=$(cd "${src%/*}/.." && pwd)
NAME=${DELTARES_TPU_NAME:-}
ZONE=${DELTARES_TPU_ZONE:-}
TYPE=${DELTARES_TPU_TYPE:-}
VERSION=${DELTARES_TPU_VERSION:-}
PROJECT=${DELTARES_TPU_PROJECT:-}
CONFIG=${DELTARES_CONFIG:-}
WORKDIR=${DELTARES_WORKDIR:-}
PYTHON=${DELTARES_TPU_PYTHON:-python3.11}
SPOT=0 DETACH=0 DRY=0 EXTRA=()

usage() {
  cat <<'EOF'
Usage: launch/tpu.sh [options] [-- train overrides...]
  --name NAME        TPU VM / pod slice name           (env DELTARES_TPU_NAME)     required
  --zone ZONE        e.g. us-east5-a                   (env DELTARES_TPU_ZONE)     required
  --type TYPE        accelerator type, e.g. v5p-8      (env DELTARES_TPU_TYPE)     required
  --config FILE:MODE e.g. experiments/s7b6.py:delta_block (env DELTARES_CONFIG)    required
  --workdir DIR      gs://BUCKET/PATH, or a path on the workers  (env DELTARES_WORKDIR) required
  --version RUNTIME  TPU software version; default from --type (env DELTARES_TPU_VERSION)
  --project PROJECT  gcloud project (env DELTARES_TPU_PROJECT; default: gcloud's)
  --python PY        Python >= 3.11 on the workers (env DELTARES_TPU_PYTHON; default python3.11)
  --spot             create a Spot TPU
  --detach           run training in the background (log: ~/deltares-train.log on each worker)
  --dry-run          print every command instead of running it
Everything after `--` is passed to `python -m deltares.train`.
EOF
}
PROG=tpu.sh
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

while (($#)); do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    --name | --zone | --type | --version | --project | --config | --workdir | --python)
      (($# >= 2)) || die "$opt needs a value"
      var=${opt#--}
      printf -v "${var^^}" '%s' "$2" # --zone z  ->  ZONE=z
      shift 2 ;;
    --spot) SPOT=1; shift ;;
    --detach) DETACH=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument '$opt' (see --help; train overrides go after --)" ;;
  esac
done

missing=()
for pair in NAME:--name ZONE:--zone TYPE:--type CONFIG:--config WORKDIR:--workdir; do
  var=${pair%%:*}
  [[ -n ${!var} ]] || missing+=("${pair#*:}")
done
((${#missing[@]} == 0)) || die "missing required setting: ${missing[*]} (flag or DELTARES_* env var, see --help)"
((DRY)) || command -v gcloud >/dev/null || die "gcloud not found on PATH (install the Google Cloud SDK, or use --dry-run)"
((DRY)) || command -v git >/dev/null || die "git not found on PATH (needed to list the files to copy)"
if [[ -z $VERSION ]]; then
  case $TYPE in
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) VERSION=tpu-ubuntu2204-base ;;
    *) die "missing required setting: --version (no default runtime for --type $TYPE)" ;;
  esac
fi
check_config_and_jax_pin

where=(--zone "$ZONE")
[[ -z $PROJECT ]] || where+=(--project "$PROJECT")
tpu=(gcloud compute tpus tpu-vm)

# 1. Create the TPU, or reuse it if it exists and is READY.
if ((DRY)); then
  run "${tpu[@]}" describe "$NAME" "${where[@]}" --format='value(state)'
  echo "# if describe fails (no such TPU):"
fi
if ((DRY)) || ! state=$("${tpu[@]}" describe "$NAME" "${where[@]}" --format='value(state)' 2>/dev/null); then
  create=("${tpu[@]}" create "$NAME" "${where[@]}" --accelerator-type "$TYPE" --version "$VERSION")
  ((SPOT)) && create+=(--spot)
  run "${create[@]}"
elif [[ $state != READY ]]; then
  die "TPU $NAME exists but is $state; delete it (gcloud compute tpus tpu-vm delete $NAME --zone $ZONE) or pick another --name"
else
  echo "tpu.sh: reusing TPU $NAME ($state)" >&2
fi

# 2. Copy the working tree (tracked and untracked files, minus .gitignore'd ones) to all workers.
TARBALL="${TMPDIR:-/tmp}/deltares-$NAME-$$.tgz"
if ((DRY)); then
  echo "+ git -C $(quote "$ROOT") ls-files -z -co --exclude-standard | tar -C $(quote "$ROOT") --null -czf $(quote "$TARBALL") -T -"
else
  trap 'rm -f "$TARBALL"' EXIT
  git -C "$ROOT" ls-files -z -co --exclude-standard \
    | (cd "$ROOT" && while IFS= read -r -d '' f; do if [[ -e $f || -L $f ]]; then printf '%s\0' "$f"; fi; done) \
    | tar -C "$ROOT" --null -czf "$TARBALL" -T -
fi
run "${tpu[@]}" scp "$TARBALL" "$NAME:deltares.tgz" "${where[@]}" --worker=all

# 3. Unpack and install on every worker: code in ~/deltares, venv in ~/deltares-venv (reused).
py=$(quote "$PYTHON") venv=deltares-venv
setup="set -e; mkdir -p deltares; tar -xzf deltares.tgz -C deltares; rm -f deltares.tgz"
setup+="; [ -x $venv/bin/pip ] || $py -m venv $venv || { sudo apt-get update -q && sudo apt-get install -yq -o DPkg::Lock::Timeout=600 $py-venv && rm -rf $venv && $py -m venv $venv; }"
setup+="; $venv/bin/pip install -q -U pip; $venv/bin/pip install -q -r deltares/requirements.txt"
setup+="; $venv/bin/pip install -q $(quote "jax[tpu]==$JAX_VERSION")"
run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=all --command "$setup"

# 4. The same training command on all workers (the trainer joins them into one JAX job).
train="../$venv/bin/python -m deltares.train $(quote --config "$CONFIG" --workdir "$WORKDIR" "${EXTRA[@]}")"
if ((DETACH)); then
  train="cd deltares && nohup $train > ../deltares-train.log 2>&1 < /dev/null &"
else
  train="cd deltares && exec $train"
fi
run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=all --command "$train"
