# shellcheck shell=bash
# Shared by launch/tpu.sh, launch/gpu.sh and launch/slurm.sh (sourced; PROG names the calling script).

START=$PWD # where the user started the launcher: their relative paths are relative to it

die() { echo "$PROG: error: $*" >&2; exit 2; }

# Shell-quote each argument (POSIX single quotes), for printing and for remote commands.
quote() {
  local a out=()
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

# Run a command, or with DRY=1 print it.
run() { if ((DRY)); then echo "+ $(quote "$@")"; else "$@"; fi; }

# local_path VAR FLAG: the path in VAR as the user meant it, for a command run from the checkout:
# `~` and `~user` expanded, a relative path taken from the directory the launcher started in,
# `.` and `..` resolved (not symlinks; the path need not exist yet); inside the checkout it is
# written relative to it (the commands run there, on every worker too), elsewhere absolute.
# A bucket URL (gs://...) is left as it is.
local_path() {
  local -n path_=$1
  local p=$path_ user home part parts out=()
  [[ -n $p && $p != *://* ]] || return 0
  # shellcheck disable=SC2088  # the literal "~" the user typed, expanded below
  if [[ $p == "~" || $p == "~/"* ]]; then
    p=$HOME${p:1}
  elif [[ $p == "~"* ]]; then
    user=${p%%/*} user=${user:1}
    home=$(getent passwd "$user" 2>/dev/null | cut -d: -f6) || true
    [[ -n $home ]] || die "$2 $p: there is no user '$user' whose home ~$user could name"
    p=$home${p:$((1 + ${#user}))}
  fi
  [[ $p == /* ]] || p=$START/$p
  IFS=/ read -ra parts <<<"$p"
  for part in "${parts[@]}"; do
    case $part in
      '' | .) ;;
      ..) ((${#out[@]} == 0)) || unset 'out[${#out[@]}-1]' ;;
      *) out+=("$part") ;;
    esac
  done
  p=$(IFS=/; echo "/${out[*]}")
  if [[ $p == "$ROOT" ]]; then p=.; elif [[ $p == "$ROOT"/* ]]; then p=${p#"$ROOT"/}; fi
  path_=$p
}

# CONFIG (FILE[:ARG]) made a path the trainer finds from the checkout (see local_path). A FILE
# that is not there but names a shipped experiment (NAME, NAME.py, experiments/NAME.py) is the
# checkout's experiments/NAME.py, as deltares.train takes it. Sets JAX_VERSION from
# requirements.txt's jax pin.
check_config_and_jax_pin() {
  local file=${CONFIG%%:*} rest='' given name
  [[ $CONFIG != *:* ]] || rest=:${CONFIG#*:}
  given=$file
  [[ -n $file ]] || die "--config names no experiment file (FILE[:MODE], e.g. experiments/tiny.py:delta_block)"
  local_path file --config
  local at=$file
  [[ $at == /* ]] || at=$ROOT/$at
  if [[ ! -e $at && ( $given != */* || ${given%/*} == experiments ) ]]; then
    name=${given##*/} name=${name%.py}.py
    if [[ -f $ROOT/experiments/$name ]]; then file=experiments/$name at=$ROOT/experiments/$name; fi
  fi
  [[ -e $at ]] || die "--config $given: no such file (a relative path is taken from $START)"
  [[ ! -d $at ]] || die "--config $given: is a folder, not an experiment file"
  [[ -r $at ]] || die "--config $given: cannot be read (permission denied)"
  CONFIG=$file$rest
  JAX_VERSION=$(sed -n 's/^jax==\([^ ;#]*\).*/\1/p' "$ROOT/requirements.txt")
  [[ -n $JAX_VERSION ]] || die "no jax==VERSION pin in requirements.txt"
}

# refuse_set_flags WHY NAME... -- ARGS...: a flag of ARGS (those passed on after the launcher's `--`)
# that sets one of NAME (`--NAME`, `--NAME=V`, `-NAME`) is one error line: the launcher sets it.
refuse_set_flags() {
  local why=$1 names=() a name
  shift
  while (($#)) && [[ $1 != -- ]]; do names+=("$1"); shift; done
  shift
  for a in "$@"; do
    [[ $a != -- ]] || return 0 # the tool's own end of flags
    for name in "${names[@]}"; do
      if [[ $a =~ ^--?$name(=|$) ]]; then
        die "${a%%=*} after -- repeats a flag that $PROG sets ($why)"
      fi
    done
  done
}
