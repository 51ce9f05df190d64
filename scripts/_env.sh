# Sourced by the scripts: creates .venv if missing and installs the project
# (plus the extras in $EXTRAS) whenever pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-}"
HASH="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "Creating virtual environment in $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
need=0
for part in base ${EXTRAS//,/ }; do
  [ -f "$VENV/.installed-$HASH-$part" ] || need=1
done
if [ "$need" = 1 ]; then
  echo "Installing sharded-jit${EXTRAS:+[$EXTRAS]} into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  for stamp in "$VENV"/.installed-*; do  # stamps of an older pyproject.toml
    case "$stamp" in "$VENV/.installed-$HASH-"*) ;; *) rm -f "$stamp" ;; esac
  done
  for part in base ${EXTRAS//,/ }; do touch "$VENV/.installed-$HASH-$part"; done
fi
PY="$VENV/bin/python"
