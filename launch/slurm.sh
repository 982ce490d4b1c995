#!/usr/bin/env bash
# Train deltares on a SLURM GPU cluster: write an sbatch job that starts one trainer process per
# node on all of that node's GPUs (jax.distributed.initialize() in deltares.train finds the job
# from SLURM's variables), and submit it. SECONDS before the time limit the trainers get SIGTERM,
# save one step they agree on and exit 0; with --requeue the job then goes back to the queue and
# resumes from that step (as after a preemption). See launch/README.md.
#
#   launch/slurm.sh --nodes 2 --gpus-per-node 8 --time 24:00:00 --partition gpu --requeue \
#       --config experiments/s7b6.py:delta_block --workdir /shared/runs/s7b6 [-- --config.key=value ...]
set -euo pipefail

src=${BASH_SOURCE[0]}
[[ $src == */* ]] || src=./$src
ROOT=$(cd "${src%/*}/.." && pwd)
CONFIG=${DELTARES_CONFIG:-}
WORKDIR=${DELTARES_WORKDIR:-}
VENV=${DELTARES_VENV:-}
NODES=1 GPUS_PER_NODE=8 TIME='' PARTITION='' ACCOUNT='' JOB_NAME=deltares CONTAINER='' MOUNTS='' LOGS=''
SAVE_BEFORE=300 REQUEUE=0 DRY=0 SBATCH=() EXTRA=()

usage() {
  cat <<'EOF'
Usage: launch/slurm.sh [options] [-- train overrides...]
  --config FILE:MODE   e.g. experiments/s7b6.py:delta_block (env DELTARES_CONFIG)  required
  --workdir DIR        run directory that every node sees (a shared filesystem or a bucket;
                       env DELTARES_WORKDIR)                                        required
  --nodes N            nodes (default 1): one trainer process on each
  --gpus-per-node G    GPUs of each node the trainer uses (default 8)
  --time T             time limit, as sbatch takes it (e.g. 24:00:00; default: the partition's)
  --partition P        sbatch --partition
  --account A          sbatch --account
  --job-name NAME      job name (default deltares)
  --logs DIR           where the job script (DIR/NAME.sbatch) and its log (DIR/NAME-JOBID.log) go
                       (default the checkout's runs/slurm)
  --sbatch OPT         one more sbatch option, e.g. --sbatch=--qos=high (repeatable)
  --container IMAGE    run in this container image (pyxis/enroot: srun --container-image), the
                       checkout mounted at its own path; its python3 trains unless --venv is given
  --mounts LIST        more container mounts, SRC:DST[,SRC:DST...] (with --container)
  --venv DIR           virtual environment every node sees (env DELTARES_VENV; default the
                       checkout's .venv; make it as launch/README.md says)
  --save-before S      SIGTERM to the trainers S seconds before the time limit (default 300)
  --requeue            requeue the job once the trainers saved before the time limit; also lets
                       SLURM requeue it after a preemption. Either way it resumes from the workdir
  --dry-run            print the job script and the sbatch command instead of submitting
A relative path is taken from the current directory; `~` is expanded.
Everything after `--` is passed to `python -m deltares.train` (but --config and --workdir).
EOF
}
PROG=slurm.sh
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

while (($#)); do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    --config | --workdir | --venv | --nodes | --gpus-per-node | --time | --partition | --account | --job-name | \
      --logs | --container | --mounts | --save-before)
      (($# >= 2)) || die "$opt needs a value"
      var=${opt#--}
      var=${var//-/_}
      printf -v "${var^^}" '%s' "$2" # --gpus-per-node 4  ->  GPUS_PER_NODE=4
      shift 2 ;;
    --sbatch) (($# >= 2)) || die "$opt needs a value"; SBATCH+=("$2"); shift 2 ;;
    --requeue) REQUEUE=1; shift ;;
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
if [[ -n $LOGS ]]; then local_path LOGS --logs; else LOGS=runs/slurm; fi
for var in NODES GPUS_PER_NODE SAVE_BEFORE; do
  flag=--${var,,}
  [[ ${!var} =~ ^[1-9][0-9]{0,5}$ ]] || die "${flag//_/-} must be a positive whole number below 1000000, not '${!var}'"
done
[[ $JOB_NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "--job-name may hold letters, digits and _.- only, not '$JOB_NAME'"
[[ -z $MOUNTS || -n $CONTAINER ]] || die "--mounts needs --container"
check_config_and_jax_pin

if [[ -n $VENV ]]; then
  [[ $VENV == /* ]] || VENV=$ROOT/$VENV
  py=$VENV/bin/python
elif [[ -n $CONTAINER ]]; then
  py=python3
else
  VENV=$ROOT/.venv py=$ROOT/.venv/bin/python
fi
((DRY)) || [[ -z $VENV || -x $py ]] || die "$py not found: make the venv on a filesystem every node sees (launch/README.md)"

# The job step: on each node one process on all G GPUs. jax's SLURM detection alone would give each
# process only the GPU numbered by its SLURM_LOCALID (its layout is a process per GPU).
step=(srun --kill-on-bad-exit=1)
if [[ -n $CONTAINER ]]; then
  mounts=$ROOT:$ROOT
  [[ $WORKDIR != /* || $WORKDIR == "$ROOT"/* ]] || mounts+=,${WORKDIR%/*}:${WORKDIR%/*} # the workdir may not exist yet
  [[ -z $MOUNTS ]] || mounts+=,$MOUNTS
  step+=("--container-image=$CONTAINER" "--container-mounts=$mounts" "--container-workdir=$ROOT")
fi
step+=(env "JAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((GPUS_PER_NODE - 1)))"
  "$py" -m deltares.train --config "$CONFIG" --workdir "$WORKDIR" "${EXTRA[@]}")

if ((REQUEUE)); then
  # shellcheck disable=SC2016 # expanded in the job
  after_save='echo "deltares: saved before the time limit; requeued"
  scontrol requeue "$SLURM_JOB_ID"'
else
  after_save='echo "deltares: saved before the time limit; submit this job again to resume"'
fi
options=(--nodes="$NODES" --ntasks-per-node=1 --gpus-per-node="$GPUS_PER_NODE")
[[ -z $TIME ]] || options+=(--time="$TIME")
[[ -z $PARTITION ]] || options+=(--partition="$PARTITION")
[[ -z $ACCOUNT ]] || options+=(--account="$ACCOUNT")
options+=(--chdir="$ROOT" --output="$LOGS/$JOB_NAME-%j.log" --open-mode=append --signal="B:USR1@$SAVE_BEFORE")
((!REQUEUE)) || options+=(--requeue)
options+=("${SBATCH[@]}")

job_script() {
  echo '#!/bin/bash'
  echo "#SBATCH --job-name=$JOB_NAME"
  local o
  for o in "${options[@]}"; do echo "#SBATCH $o"; done
  cat <<EOF
# Written by launch/slurm.sh. USR1 (--signal) before the time limit: SIGTERM to the trainers, which
# save the step they agree on and exit 0. A TERM to this shell (scancel, a preemption) is passed on.
echo "deltares: job \$SLURM_JOB_ID, restart \${SLURM_RESTART_COUNT:-0}, nodes \$SLURM_JOB_NODELIST"
limit=0 trapped=0 step=''
trap 'limit=1 trapped=1; [[ -z \$step ]] || kill -TERM \$step' USR1
trap 'trapped=1; [[ -z \$step ]] || kill -TERM \$step' TERM
$(quote "${step[@]}") &
step=\$!
wait \$step; rc=\$?
while ((trapped)); do # a trapped signal ends a wait early: wait again, for the step's own exit status
  trapped=0
  wait \$step; rc=\$?
done
if ((limit && rc == 0)); then
  $after_save
fi
exit \$rc
EOF
}

file=$LOGS/$JOB_NAME.sbatch
run cd "$ROOT"
if ((DRY)); then
  echo "# $file:"
  job_script
  run mkdir -p "$LOGS"
  run sbatch --parsable "$file"
  exit 0
fi
command -v sbatch >/dev/null || die "sbatch not found on PATH (run this on a login node of the cluster)"
mkdir -p "$LOGS"
job_script >"$file"
err=$(mktemp)
trap 'rm -f "$err"' EXIT
id=$(sbatch --parsable "$file" 2>"$err") || die "sbatch refused $file: $(tr '\n' ' ' <"$err")"
echo "submitted job ${id%%;*}: $file, log $LOGS/$JOB_NAME-${id%%;*}.log"
