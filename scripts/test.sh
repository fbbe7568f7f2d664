#!/usr/bin/env bash
# Installs what the tests need (system packages including chromium, a virtualenv, Anvil, cast, solc,
# ethers, viem and puppeteer-core from npm) and runs lint, type checks, the docs site's strict build and the
# whole test suite.
# Safe to run again: each step skips what is present.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)  # the real-browser test (tests/test_browser_page.py)
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
APT=(env DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=300)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]} (Debian packages)"
  "${APT[@]}" update -qq
  "${APT[@]}" install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# kubectl renders the deploy/kubernetes overlays (its kustomize v3 or later: 1.21+). Debian has no
# package of its own that new: the `kubectl` package of the Kubernetes apt repository (pkgs.k8s.io) or
# the Google Cloud SDK's. Without one the rest runs, and the overlay tests fail saying so.
if ! command -v kubectl >/dev/null 2>&1; then
  "${APT[@]}" update -qq
  "${APT[@]}" install -y -qq --no-install-recommends kubectl >/dev/null 2>&1 \
    || echo "kubectl: no apt package here; add the Kubernetes apt repository (pkgs.k8s.io) for the overlay tests" >&2
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,fast,docs]'

if [ ! -x .tools/node_modules/.bin/anvil ] || [ ! -x .tools/node_modules/.bin/solcjs ] \
   || [ ! -d .tools/node_modules/ethers ] || [ ! -d .tools/node_modules/viem ] \
   || [ ! -x .tools/node_modules/.bin/cast ] || [ ! -d .tools/node_modules/puppeteer-core ]; then
  echo "installing anvil, cast, solc, ethers, viem and puppeteer-core from npm into .tools/"
  npm install --silent --no-audit --no-fund --prefix .tools @foundry-rs/anvil@1.7.1 @foundry-rs/cast@1.7.1 solc@0.8.26 \
    ethers@6 viem@2 puppeteer-core@24 >/dev/null
fi
export ANVIL_BIN="$PWD/.tools/node_modules/.bin/anvil"

.venv/bin/ruff check proxy tests bench scripts
.venv/bin/ruff format --check proxy tests bench scripts
.venv/bin/mypy
# The documentation site: a broken link or anchor fails here (mkdocs.yml turns them into warnings, --strict into errors).
site_dir=$(mktemp -d)
.venv/bin/mkdocs build --strict --site-dir "$site_dir"  # not --quiet: it hides the warnings --strict counts
rm -rf "$site_dir"
# TEST_WORKERS processes share the tests (pytest-xdist), each file whole on one of them: as many as
# the CI machine's cores; TEST_WORKERS=0 runs them in this process.
.venv/bin/pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
