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
