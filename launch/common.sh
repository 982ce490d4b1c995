# Shared by launch/tpu.sh and launch/gpu.sh (sourced; PROG names the calling script).

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

# The experiment file of CONFIG must exist; sets JAX_VERSION from requirements.txt's jax pin.
check_config_and_jax_pin() {
  [[ -f $ROOT/${CONFIG%%:*} ]] || die "config file ${CONFIG%%:*} not found (give it relative to the repository root $ROOT)"
  JAX_VERSION=$(sed -n 's/^jax==\([^ ;#]*\).*/\1/p' "$ROOT/requirements.txt")
  [[ -n $JAX_VERSION ]] || die "no jax==VERSION pin in requirements.txt"
}
