# Sourced by scripts/env.sh, engine_env.sh and gpu_env.sh: find Python 3.12 and build a pinned
# venv once, cached outside the clone under a lock (another clone may be building the same one).
#   MGSPO_CACHE   where venvs are kept (default ~/.cache/megatron-gspo)

mgspo_find_python312() {
  local c
  if c=$(command -v python3.12 2>/dev/null) && "$c" -c 'import sys' 2>/dev/null; then
    echo "$c"; return
  fi
  for c in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$c" ]; then echo "$c"; return; fi
  done
  echo "error: Python 3.12 not found (megatron-core 0.19 and sglang need it); install it," \
    "e.g. 'pyenv install 3.12'" >&2
  return 1
}

# mgspo_cached_venv NAME HASH INSTALL_FN: print the venv directory <cache>/NAME-HASH, building it
# first if needed: a fresh venv with pip 26.3, then `INSTALL_FN <venv>` (its output to stderr).
mgspo_cached_venv() {
  local name=$1 hash=$2 install=$3
  local cache=${MGSPO_CACHE:-$HOME/.cache/megatron-gspo}
  local venv="$cache/$name-$hash" py start
  if [ ! -f "$venv/.complete" ]; then
    mkdir -p "$cache"
    exec 9>"$cache/.lock-$name-$hash"
    flock 9
    if [ ! -f "$venv/.complete" ]; then
      py=$(mgspo_find_python312)
      echo "[$name] building $venv with $py (one time)" >&2
      start=$(date +%s)
      rm -rf "$venv"
      "$py" -m venv "$venv"
      "$venv/bin/python" -m pip install -q --disable-pip-version-check pip==26.3 >&2
      "$install" "$venv" >&2
      touch "$venv/.complete"
      echo "[$name] ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
    fi
    exec 9>&-
  fi
  echo "$venv"
}
