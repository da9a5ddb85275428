# Sourced by scripts/gpu-tests.sh and scripts/gpu-quick.sh: running steps
# under a time limit, and reading `weft bench` tables.

failed=()

# step NAME CMD...: run one step under `timeout` ($step_limit seconds),
# remember a failure and go on.
step() {
  local name=$1
  shift
  echo "== $name ($(date +%T))"
  timeout -k 10 "$step_limit" "$@"
  local rc=$?
  if ((rc != 0)); then
    echo "!! $name: exit $rc"
    failed+=("$name")
  fi
}

# field FILE OP COLUMN: the time (7) or busbw (12) of OP in a bench table.
field() { awk -v op="$2" -v c="$3" '$NF == op && $1 !~ /^#/ { print $c }' "$1" 2>/dev/null; }

# ratio A B: A / B to two decimals, or n/a.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else print "n/a" }'; }

# finish: the steps' verdict and exit status.
finish() {
  if ((${#failed[@]})); then
    printf '!! failed: %s\n' "${failed[@]}"
    exit 1
  fi
  echo "== all steps passed"
}
