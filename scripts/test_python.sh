#!/usr/bin/env bash
# The Python half of the README's test command: installs the lutb package and its test
# requirements (pyproject.toml, extra "test": torch 2.11 from PyPI, transformers 5.17.0, ...) into
# the virtual environment build/venv, then runs pytest on tests/python.
#   `pip install .` builds the extension in build/release against the library objects the release
#   preset built there (cmake --preset release && cmake --build --preset release), so only
#   python/src compiles. CUDA tests (marker `cuda`) skip without a GPU; pass pytest arguments after
#   the script's name (e.g. -m cuda for the GPU tests only).
# Exit status: pytest's; "no tests collected" (pytest's 5) is a failure here.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${LUTB_VENV:-build/venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The build requirements live in the venv (no isolated build environment), so the build folder keeps
# pointing at the same nanobind sources and a second run recompiles nothing. Without isolation a test
# requirement published only as an sdist (lm-eval's rouge-score) is built with the venv's own
# setuptools, which before 70.1 has no bdist_wheel without the wheel package ("invalid command
# 'bdist_wheel'" in a fresh venv of Python 3.11, which bundles setuptools 65).
"$venv/bin/python" -m pip install -q --upgrade pip "scikit-build-core>=0.10" "nanobind>=2.0" wheel
"$venv/bin/python" -m pip install -q --no-build-isolation ".[test]"
rc=0
"$venv/bin/python" -m pytest tests/python -q "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test_python.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
