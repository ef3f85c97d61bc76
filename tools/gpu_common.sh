# Sourced by the device scripts: carried wheels, the package namespace (the checkout is not installed there) and the
# shipping of what a campaign changed under data/ as one tarball in $OUT.
# $WHEELS: a folder of wheels the machine lacks (megatron-core, torchao) installed first, importable after
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  EXTRA_PATH=/tmp/site${EXTRA_PATH:+:$EXTRA_PATH}
fi
# a step's failure is its pipeline's (each collector runs piped through tail) and the script's exit status: what
# was collected still ships, and the call reports the failure instead of rc 0
set -o pipefail
FAILED=0
trap 'rc=$?; [[ $BASH_COMMAND == return* ]] || echo "step failed (rc $rc): $BASH_COMMAND" >&2; FAILED=$rc' ERR
mkdir -p .ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" .ns/tp_query/$d; done
export PYTHONPATH=$PWD/.ns${EXTRA_PATH:+:$EXTRA_PATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

ship() {  # ship NAME: changed and new files under data/ -> $OUT/NAME.tgz (deleted ones listed in gone.txt)
  find data -name .lock -delete
  { git ls-files -o --exclude-standard data; git diff --name-only -- data; } | sort -u \
    | while read -r f; do [ -e "$f" ] && echo "$f"; done > /tmp/ship.txt  # deleted ones go to gone.txt
  git ls-files -d data > "$OUT/gone.txt"
  tar czf "$OUT/$1.tgz" -T /tmp/ship.txt && wc -l < /tmp/ship.txt
  return "$FAILED"
}

gpu_kind() {  # h200 or h100 from the first GPU's name (a call for nvidia-h200 may land on an H100); else exit 3
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
    *H200*) echo h200 ;; *H100*) echo h100 ;; *) echo "neither an H200 nor an H100" >&2; return 3 ;;
  esac
}
