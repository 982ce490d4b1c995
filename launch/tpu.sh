#!/usr/bin/env bash
# Train deltares on a Cloud TPU VM or pod slice: create (or reuse) it, copy this working
# tree to every worker, install the requirements plus jax[tpu], start the same training
# command on all workers, detached from the SSH session (each worker logs to
# ~/deltares-logs/NAME.log). The workers find each other with a bare
# jax.distributed.initialize() (deltares.train); SIGTERM to any of them (--stop, a
# preemption) makes all save the same step and exit 0. See launch/README.md.
#
#   launch/tpu.sh --name NAME --zone ZONE --type v5p-16 \
#       --config experiments/s7b6.py:delta_block --workdir gs://BUCKET/run [-- --config.key=value ...]
#   launch/tpu.sh --name NAME --zone ZONE --logs    # follow worker 0's log
#   launch/tpu.sh --name NAME --zone ZONE --stop    # SIGTERM on every worker: save, exit
#   launch/tpu.sh --name NAME --zone ZONE --type v5p-16 --prepare -- --source ... --out gs://BUCKET/data
#       # deltares.data.prepare on every worker, each tokenizing its share (--shard I --num_shards N)
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
SPOT=0 DRY=0 ACTION=start EXTRA=()

usage() {
  cat <<'EOF'
Usage: launch/tpu.sh [options] [-- train overrides...]      start training on every worker
       launch/tpu.sh --name NAME --zone ZONE --type TYPE --prepare -- PREPARE FLAGS...
       launch/tpu.sh --name NAME --zone ZONE --logs|--stop
  --name NAME        TPU VM / pod slice name           (env DELTARES_TPU_NAME)     required
  --zone ZONE        e.g. us-east5-a                   (env DELTARES_TPU_ZONE)     required
  --type TYPE        accelerator type, e.g. v5p-8      (env DELTARES_TPU_TYPE)     required
  --config FILE:MODE e.g. experiments/s7b6.py:delta_block (env DELTARES_CONFIG)    required
  --workdir DIR      gs://BUCKET/PATH, or a path on the workers  (env DELTARES_WORKDIR) required
  --version RUNTIME  TPU software version; default from --type (env DELTARES_TPU_VERSION)
  --project PROJECT  gcloud project (env DELTARES_TPU_PROJECT; default: gcloud's)
  --python PY        Python >= 3.11 on the workers (env DELTARES_TPU_PYTHON; default python3.11)
  --spot             create a Spot TPU
  --logs             follow worker 0's log (~/deltares-logs/NAME.log); Ctrl-C leaves training running
  --stop             SIGTERM to the trainer on every worker: all save the same step, then exit
  --prepare          run python -m deltares.data.prepare on every worker instead of training, each
                     worker with --shard (its number) --num_shards (the slice's workers); log
                     ~/deltares-logs/NAME-prepare.log; --config and --workdir are not needed
  --dry-run          print every command instead of running it
Everything after `--` is passed to `python -m deltares.train` (with --prepare: to
`python -m deltares.data.prepare`), but the flags this script sets (--config and --workdir;
--shard and --num_shards). Both run detached from the SSH session, so a dropped
connection does not end them. --config is taken from the current directory (`~` expanded); a
file outside the copied checkout is copied too, as .launch/FILE. --workdir is a path on the
workers (relative to ~/deltares there) or a bucket.
EOF
}
PROG=tpu.sh
# shellcheck source=launch/common.sh
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
    --logs | --stop | --prepare) [[ $ACTION == start || $ACTION == "${opt#--}" ]] || die "--logs, --stop and --prepare exclude each other"
      ACTION=${opt#--}; shift ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument '$opt' (see --help; train overrides go after --)" ;;
  esac
done

required=(NAME:--name ZONE:--zone)
[[ $ACTION != start ]] || required+=(TYPE:--type CONFIG:--config WORKDIR:--workdir)
[[ $ACTION != prepare ]] || required+=(TYPE:--type)
missing=()
for pair in "${required[@]}"; do
  var=${pair%%:*}
  [[ -n ${!var} ]] || missing+=("${pair#*:}")
done
((${#missing[@]} == 0)) || die "missing required setting: ${missing[*]} (flag or DELTARES_* env var, see --help)"
if [[ $ACTION == prepare ]]; then
  refuse_set_flags "each worker gets its own share" shard num_shards -- "${EXTRA[@]}"
else
  refuse_set_flags "give it before --" config workdir -- "${EXTRA[@]}"
fi
((DRY)) || command -v gcloud >/dev/null || die "gcloud not found on PATH (install the Google Cloud SDK, or use --dry-run)"

where=(--zone "$ZONE")
[[ -z $PROJECT ]] || where+=(--project "$PROJECT")
tpu=(gcloud compute tpus tpu-vm)

# On each worker (commands run in the home directory): the trainer's log and pid files, and a
# test that sets pid and is true while it names a live trainer (not a recycled pid, nor a zombie
# where no init reaps it: its command line is empty).
log=$(quote "deltares-logs/$NAME.log") pidfile=$(quote "deltares-logs/$NAME.pid")
alive="grep -qa deltares.train /proc/\$pid/cmdline 2>/dev/null"
running="[ -f $pidfile ] && pid=\$(cat $pidfile) && $alive"

if [[ $ACTION == logs ]]; then
  run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=0 --command "tail -n 200 -F $log"
  exit
fi
if [[ $ACTION == stop ]]; then
  # SIGTERM is the preemption notice of jax's preemption service: the workers agree on a step,
  # save it and exit 0. Waits until the trainer is gone, so that the TPU can then be deleted.
  stop="if $running; then kill -TERM \$pid; echo \"\$(hostname): SIGTERM to \$pid, waiting for it to save and exit\""
  stop+="; while $alive; do sleep 1; done; echo \"\$(hostname): stopped\"; else echo \"\$(hostname): no training running\"; fi"
  run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=all --command "$stop"
  exit
fi
((DRY)) || command -v git >/dev/null || die "git not found on PATH (needed to list the files to copy)"
if [[ -z $VERSION ]]; then
  case $TYPE in
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) VERSION="tpu-ubuntu2204-base" ;;
    *) die "missing required setting: --version (no default runtime for --type $TYPE)" ;;
  esac
fi
[[ $ACTION == prepare ]] || check_config_and_jax_pin
[[ $ACTION != prepare ]] || JAX_VERSION=$(sed -n 's/^jax==\([^ #]*\).*/\1/p' "$ROOT/requirements.txt")

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

# 2. Copy the working tree (tracked and untracked files, minus .gitignore'd ones) to all workers,
# and an experiment file that is not among them as .launch/FILE.
TARBALL="${TMPDIR:-/tmp}/deltares-$NAME-$$.tgz" STAGE='' extra=()
((DRY)) || trap 'rm -rf "$TARBALL" ${STAGE:+"$STAGE"}' EXIT
if [[ $ACTION == start ]] && { [[ $CONFIG == /* ]] || ! git -C "$ROOT" ls-files -co --exclude-standard --error-unmatch \
  -- "${CONFIG%%:*}" >/dev/null 2>&1; }; then
  file=${CONFIG%%:*} rest=${CONFIG:${#file}}
  [[ $file == /* ]] || file=$ROOT/$file
  STAGE="${TMPDIR:-/tmp}/deltares-$NAME-$$.d"
  extra=(-C "$STAGE" ".launch/${file##*/}")
  CONFIG=.launch/${file##*/}$rest
  run mkdir -p "$STAGE/.launch"
  run cp "$file" "$STAGE/.launch/"
fi
if ((DRY)); then
  echo "+ git -C $(quote "$ROOT") ls-files -z -co --exclude-standard | tar -C $(quote "$ROOT") --null -czf $(quote "$TARBALL") -T -${extra[*]:+ $(quote "${extra[@]}")}"
else
  git -C "$ROOT" ls-files -z -co --exclude-standard \
    | (cd "$ROOT" && while IFS= read -r -d '' f; do if [[ -e $f || -L $f ]]; then printf '%s\0' "$f"; fi; done) \
    | tar -C "$ROOT" --null -czf "$TARBALL" -T - "${extra[@]}"
fi
run "${tpu[@]}" scp "$TARBALL" "$NAME:deltares.tgz" "${where[@]}" --worker=all

# 3. Unpack and install on every worker: code in ~/deltares, venv in ~/deltares-venv (reused);
# not under a trainer that is still running.
py=$(quote "$PYTHON") venv=deltares-venv
setup="set -e; if $running; then echo \"\$(hostname): error: training is still running (pid \$pid); stop it first with launch/tpu.sh --stop\" >&2; exit 1; fi"
setup+="; mkdir -p deltares; tar -xzf deltares.tgz -C deltares; rm -f deltares.tgz"
setup+="; [ -x $venv/bin/pip ] || $py -m venv $venv || { sudo apt-get update -q && sudo apt-get install -yq -o DPkg::Lock::Timeout=600 $py-venv && rm -rf $venv && $py -m venv $venv; }"
setup+="; $venv/bin/pip install -q -U pip; $venv/bin/pip install -q -r deltares/requirements.txt"
setup+="; $venv/bin/pip install -q $(quote "jax[tpu]==$JAX_VERSION")"
run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=all --command "$setup"

# 4p. With --prepare: the same prepare command on all workers, each with its share of the units. The
# TPU VM's metadata server tells a worker its number and the slice's workers.
if [[ $ACTION == prepare ]]; then
  plog=$(quote "deltares-logs/$NAME-prepare.log")
  meta="curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes"
  shard="--shard \$($meta/agent-worker-number) --num_shards \$($meta/worker-network-endpoints | tr ',' '\\n' | wc -l)"
  prep="exec ../$venv/bin/python -m deltares.data.prepare $(quote "${EXTRA[@]}") $shard"
  start="set -e; mkdir -p deltares-logs; echo \"== \$(date -u +%FT%TZ) launch/tpu.sh prepare\" >> $plog; cd deltares"
  start+="; setsid nohup bash -c $(quote "$prep") >> ../$plog 2>&1 < /dev/null &"
  run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=all --command "$start"
  ((DRY)) || echo "tpu.sh: prepare runs detached on every worker of $NAME, logging to ~/deltares-logs/$NAME-prepare.log;" \
    "the worker that finishes the last unit writes meta.json" >&2
  exit
fi

# 4. The same training command on all workers (the trainer joins them into one JAX job), in a
# new session (setsid) that ignores the hangup (nohup), its output appended to the log; the
# shell writes its pid, which exec hands to python, to the pid file.
# Only that command goes to the background (`&` would take a whole `a && b` list, whose shell
# then holds the SSH session open until training ends).
train="exec ../$venv/bin/python -m deltares.train $(quote --config "$CONFIG" --workdir "$WORKDIR" "${EXTRA[@]}")"
start="set -e; mkdir -p deltares-logs; echo \"== \$(date -u +%FT%TZ) launch/tpu.sh start\" >> $log; cd deltares"
start+="; setsid nohup bash -c $(quote "echo \$\$ > ../$pidfile; $train") >> ../$log 2>&1 < /dev/null &"
run "${tpu[@]}" ssh "$NAME" "${where[@]}" --worker=all --command "$start"
((DRY)) || echo "tpu.sh: training runs detached on every worker of $NAME, logging to ~/deltares-logs/$NAME.log;" \
  "follow worker 0 with --logs, stop (save and exit) with --stop" >&2
