#!/usr/bin/env bash
# Train deltares on a SLURM cluster: write an sbatch job that starts one trainer process per node on
# all of that node's GPUs, CPUs and memory (jax.distributed.initialize() in deltares.train finds the
# job from SLURM's variables), and submit it. SECONDS before the time limit the job script gets USR1
# and has SLURM send SIGTERM to the trainers (as a preemption with a grace time or `scancel
# --signal=TERM` do); they save one step they agree on and exit 75, and the job requeues itself and
# resumes from that step. A finished run (exit 0) is not requeued. See launch/README.md.
#
#   launch/slurm.sh --nodes 2 --gpus-per-node 8 --time 24:00:00 --partition gpu \
#       --config experiments/s7b6.py:delta_block --workdir /shared/runs/s7b6 [-- --config.key=value ...]
set -euo pipefail

src=${BASH_SOURCE[0]}
[[ $src == */* ]] || src=./$src
ROOT=$(cd "${src%/*}/.." && pwd)
CONFIG=${DELTARES_CONFIG:-}
WORKDIR=${DELTARES_WORKDIR:-}
VENV=${DELTARES_VENV:-}
NODES=1 GPUS_PER_NODE=8 CPUS_PER_NODE=all MEM=all TIME='' PARTITION='' ACCOUNT='' JOB_NAME=deltares CONTAINER=''
MOUNTS='' LOGS='' SAVE_BEFORE=300 REQUEUE=1 DRY=0 SBATCH=() EXTRA=()
STOPPED=75 # the trainers' exit status after a signal made them save before their last step (EX_TEMPFAIL)

usage() {
  cat <<'EOF'
Usage: launch/slurm.sh [options] [-- train overrides...]
  --config FILE:MODE   e.g. experiments/s7b6.py:delta_block (env DELTARES_CONFIG)  required
  --workdir DIR        run directory that every node sees (a shared filesystem or a bucket;
                       env DELTARES_WORKDIR)                                        required
  --nodes N            nodes (default 1): one trainer process on each
  --gpus-per-node G    GPUs of each node the trainer uses (default 8; 0: nodes without GPUs,
                       the trainer runs on the CPU)
  --cpus-per-node C    CPUs of each node for its trainer (default all: the nodes are the job's
                       alone, sbatch --exclusive)
  --mem M              memory of each node, as sbatch --mem takes it (e.g. 500G; default all)
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
  --save-before S      seconds before the time limit when the trainers get SIGTERM to save
                       (default 300; less than --time)
  --no-requeue         a run that a signal stopped is not requeued (its log says to submit the
                       job again), nor is the job after a preemption or a node failure;
                       --requeue (the default) requeues it in each case
  --dry-run            print the job script and the sbatch command instead of submitting
A relative path is taken from the current directory; `~` is expanded.
Everything after `--` is passed to `python -m deltares.train` (but --config, --workdir and
--stopped_exit_code, which it sets).
EOF
}
PROG=slurm.sh
# shellcheck source=launch/common.sh
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

while (($#)); do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    --config | --workdir | --venv | --nodes | --gpus-per-node | --cpus-per-node | --mem | --time | --partition | \
      --account | --job-name | --logs | --container | --mounts | --save-before)
      (($# >= 2)) || die "$opt needs a value"
      var=${opt#--}
      var=${var//-/_}
      printf -v "${var^^}" '%s' "$2" # --gpus-per-node 4  ->  GPUS_PER_NODE=4
      shift 2 ;;
    --sbatch) (($# >= 2)) || die "$opt needs a value"; SBATCH+=("$2"); shift 2 ;;
    --requeue) REQUEUE=1; shift ;;
    --no-requeue) REQUEUE=0; shift ;;
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
refuse_set_flags "the job script reads the exit status it sets" stopped_exit_code -- "${EXTRA[@]}"
local_path WORKDIR --workdir
local_path VENV --venv
if [[ -n $LOGS ]]; then local_path LOGS --logs; else LOGS=runs/slurm; fi
for var in NODES SAVE_BEFORE; do
  flag=--${var,,}
  [[ ${!var} =~ ^[1-9][0-9]{0,5}$ ]] || die "${flag//_/-} must be a positive whole number below 1000000, not '${!var}'"
done
[[ $GPUS_PER_NODE =~ ^(0|[1-9][0-9]{0,5})$ ]] ||
  die "--gpus-per-node must be a whole number below 1000000 (0: nodes without GPUs), not '$GPUS_PER_NODE'"
[[ $CPUS_PER_NODE == all || $CPUS_PER_NODE =~ ^[1-9][0-9]{0,5}$ ]] ||
  die "--cpus-per-node must be 'all' or a positive whole number below 1000000, not '$CPUS_PER_NODE'"
[[ $MEM == all || $MEM =~ ^[1-9][0-9]{0,8}[KMGT]?$ ]] ||
  die "--mem must be 'all' or a size as sbatch --mem takes it (a number of megabytes, or with K, M, G or T), not '$MEM'"

# --time in seconds, as SLURM reads it (minutes; MM:SS; HH:MM:SS; D-HH[:MM[:SS]]), rounded up to whole
# minutes as SLURM does; empty for no limit (0, infinite, unlimited).
time_seconds() {
  local t=${1,,} d=0 h=0 m=0 s=0
  if [[ $t == 0 || $t == infinite || $t == unlimited ]]; then
    return
  elif [[ $t =~ ^([0-9]{1,6})$ ]]; then
    m=${BASH_REMATCH[1]}
  elif [[ $t =~ ^([0-9]{1,6}):([0-9]{1,6})$ ]]; then
    m=${BASH_REMATCH[1]} s=${BASH_REMATCH[2]}
  elif [[ $t =~ ^([0-9]{1,6}):([0-9]{1,6}):([0-9]{1,6})$ ]]; then
    h=${BASH_REMATCH[1]} m=${BASH_REMATCH[2]} s=${BASH_REMATCH[3]}
  elif [[ $t =~ ^([0-9]{1,5})-([0-9]{1,6})(:([0-9]{1,6})(:([0-9]{1,6}))?)?$ ]]; then
    d=${BASH_REMATCH[1]} h=${BASH_REMATCH[2]} m=${BASH_REMATCH[4]:-0} s=${BASH_REMATCH[6]:-0}
  else
    die "--time must be as sbatch takes it (MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS or DAYS-HOURS[:MINUTES[:SECONDS]]), not '$1'"
  fi
  echo $((((10#$d * 24 + 10#$h) * 60 + 10#$m) * 60 + (10#$s + 59) / 60 * 60))
}
if [[ -n $TIME ]]; then
  limit=$(time_seconds "$TIME") || exit 2
  [[ -z $limit ]] || ((SAVE_BEFORE < limit)) ||
    die "--save-before $SAVE_BEFORE is not less than --time $TIME ($limit seconds): SLURM would signal the job as soon as it starts"
fi
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

# The job step: on each node one process on all G GPUs (jax's SLURM detection alone would give each
# process only the GPU numbered by its SLURM_LOCALID: its layout is a process per GPU), or on the CPU.
step=(srun --kill-on-bad-exit=1)
[[ $CPUS_PER_NODE == all ]] || step+=("--cpus-per-task=$CPUS_PER_NODE") # srun does not take it from sbatch
if [[ -n $CONTAINER ]]; then
  mounts=$ROOT:$ROOT
  [[ $WORKDIR != /* || $WORKDIR == "$ROOT"/* ]] || mounts+=,${WORKDIR%/*}:${WORKDIR%/*} # the workdir may not exist yet
  [[ -z $MOUNTS ]] || mounts+=,$MOUNTS
  step+=("--container-image=$CONTAINER" "--container-mounts=$mounts" "--container-workdir=$ROOT")
fi
if ((GPUS_PER_NODE)); then
  step+=(env "JAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((GPUS_PER_NODE - 1)))")
else
  step+=(env JAX_PLATFORMS=cpu)
fi
step+=("$py" -m deltares.train --config "$CONFIG" --workdir "$WORKDIR" "--stopped_exit_code=$STOPPED" "${EXTRA[@]}")

options=(--nodes="$NODES" --ntasks-per-node=1)
((!GPUS_PER_NODE)) || options+=(--gpus-per-node="$GPUS_PER_NODE")
if [[ $CPUS_PER_NODE == all ]]; then options+=(--exclusive); else options+=(--cpus-per-task="$CPUS_PER_NODE"); fi
if [[ $MEM == all ]]; then options+=(--mem=0); else options+=(--mem="$MEM"); fi
[[ -z $TIME ]] || options+=(--time="$TIME")
[[ -z $PARTITION ]] || options+=(--partition="$PARTITION")
[[ -z $ACCOUNT ]] || options+=(--account="$ACCOUNT")
options+=(--chdir="$ROOT" --output="$LOGS/$JOB_NAME-%j.log" --open-mode=append --signal="B:USR1@$SAVE_BEFORE")
if ((REQUEUE)); then options+=(--requeue); else options+=(--no-requeue); fi
options+=("${SBATCH[@]}")

# shellcheck disable=SC2016 # expanded in the job
if ((REQUEUE)); then
  resume='echo "deltares: the trainers stopped (exit $rc); requeueing the job, which resumes from the last checkpoint"
    scontrol requeue "$SLURM_JOB_ID" && exit 0'
else
  resume='echo "deltares: the trainers stopped (exit $rc); submit this job again to resume from the last checkpoint"'
fi

job_script() {
  echo '#!/bin/bash'
  echo "#SBATCH --job-name=$JOB_NAME"
  local o
  for o in "${options[@]}"; do echo "#SBATCH $o"; done
  cat <<EOF
# Written by launch/slurm.sh. SLURM sends SIGTERM to the trainers before the time limit (this script
# asks for it at USR1), at a preemption with a grace time, at \`scancel --signal=TERM\`, \`scancel\`,
# \`scontrol requeue\` and a node failure; they save the step they agree on and exit $STOPPED (143 if
# the signal came before their first step). Where SLURM itself sent this script TERM (scancel, a
# requeue, a node failure, the time limit reached), SLURM ends or requeues the job; otherwise the job
# requeues itself. A finished run exits 0. SIGTERM to srun would kill the trainers unsaved.
echo "deltares: job \$SLURM_JOB_ID, restart \${SLURM_RESTART_COUNT:-0}, nodes \$SLURM_JOB_NODELIST"
limit=0 slurm=0 trapped=0
trap 'limit=1 trapped=1; echo "deltares: the time limit is near: SIGTERM to the trainers"; scancel --signal=TERM "\$SLURM_JOB_ID"' USR1
trap 'slurm=1 trapped=1' TERM
$(quote "${step[@]}") &
step=\$!
wait \$step; rc=\$?
while ((trapped)); do # a trapped signal ends a wait early: wait again, for the step's own exit status
  trapped=0
  wait \$step; rc=\$?
done
if ((rc == 0)); then
  echo "deltares: the run is finished"
elif ((rc == $STOPPED || rc == 143)) && ((limit || !slurm)); then
  # SLURM's own TERM (scancel, its requeue) may reach this script after the trainers' exit: ask its state
  state=\$(scontrol show job -o "\$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*')
  if [[ -z \$state || \$state == JobState=RUNNING ]]; then
    $resume
  fi
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
