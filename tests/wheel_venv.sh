#!/usr/bin/env bash
# Installs WHEEL with pip into a fresh virtual environment at VENV made by BASE (a venv's
# Python), which sees BASE's packages (torch and what the tests import) through a .pth file, so
# that nothing but the wheel is installed anew. Prints the venv's site-packages folder.
#
#     bash tests/wheel_venv.sh VENV BASE WHEEL
set -euo pipefail
venv=$1
base=$2
wheel=$3
site_of() { "$1" -c "import site; print(site.getsitepackages()[0])"; }

rm -rf "$venv"
"$base" -m venv "$venv"
site=$(site_of "$venv/bin/python")
site_of "$base" >"$site/base-venv.pth"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel" 2>&1 |
	{ grep -v "is neither a file nor a directory" || true; }
echo "$site"
