# Shared set-up for the scripts beside this directory; sourced, never run. The caller defines
# `log` and `die`.

# debian_packages PACKAGE...: apt-get installs each PACKAGE whose command of the same name is
# missing (redis-server, haproxy, ...), with sudo when not root.
debian_packages() {
  local missing=() p sudo
  for p in "$@"; do
    command -v "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  log "installing ${missing[*]} (apt-get)"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}" \
    || die "could not install ${missing[*]}"
}

# python_with_yaml CACHE VERSION: sets PYTHON to a python3 that imports yaml: python3's own if
# it has it, else a venv in CACHE/venv (outside the repository) with PyYAML==VERSION.
python_with_yaml() {
  local cache="$1" version="$2" venv="$1/venv"
  PYTHON=python3
  "$PYTHON" -c 'import yaml' >/dev/null 2>&1 && return 0
  if ! "$venv/bin/python" -c 'import yaml' >/dev/null 2>&1; then
    log "installing PyYAML==$version into $venv"
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    "$venv/bin/python" -m pip --disable-pip-version-check -q install "PyYAML==$version" \
      || die "pip could not install PyYAML==$version"
  fi
  PYTHON="$venv/bin/python"
}
