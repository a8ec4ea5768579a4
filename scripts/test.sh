#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the whole test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
# Two workers (pytest-xdist), each taking whole modules (a module's shared servers start once): many tests are
# process starts and imports, one core busy at a time, so two at once take ~0.8x the time on 2 cores
# (docs/guides/testing.md). DCPCTL_TEST_WORKERS=0 runs them in this process, one after another (as `-n 0` does).
.venv/bin/python -m pytest -n "${DCPCTL_TEST_WORKERS:-2}" --dist loadscope "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
