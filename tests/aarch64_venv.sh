#!/usr/bin/env bash
# Installs an aarch64 fasthooks wheel with pip into a fresh virtual environment of the aarch64
# Python that tests/aarch64.sh unpacked in DIR, everything run under qemu-aarch64: the venv
# (DIR/venv) sees DIR/site (torch 2.10.0's aarch64 CPU wheel and the test packages) through a
# .pth file, and pip is the host's (pure Python), run by the aarch64 interpreter, so it picks the
# wheel by that interpreter's own platform tags. Without DIR/root or the wheel it says so and
# installs nothing.
#
#     bash tests/aarch64_venv.sh DIR WHEEL PYTHON   (PYTHON: the host interpreter, for its pip)
set -euo pipefail
dir=$(realpath -m "$1")
wheel=$2
python=$3
say() { echo "aarch64 venv: $*" >&2; }

qemu=$(command -v qemu-aarch64 || true)
if [[ ! -f "$dir/root/.ready" || ! -f "$dir/site/.ready" || ! -f "$wheel" || -z "$qemu" ]]; then
	say "no aarch64 Python, site, wheel or qemu-aarch64; not installed"
	exit 0
fi
aarch64_python() { "$qemu" -L "$dir/root" "$@"; }

rm -rf "$dir/venv" "$dir/pip"
aarch64_python "$dir/root/usr/bin/python3.11" -m venv --without-pip "$dir/venv"
site=$(aarch64_python "$dir/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
echo "$dir/site" >"$site/aarch64-site.pth"
# Only pip from the host's packages: the rest of them are x86-64 builds.
mkdir -p "$dir/pip"
ln -s "$("$python" -c "import os, pip; print(os.path.dirname(pip.__file__))")" "$dir/pip/pip"
PYTHONPATH="$dir/pip" aarch64_python "$dir/venv/bin/python" -m pip install -q \
	--disable-pip-version-check --no-index --no-deps "$wheel"
say "installed $(basename "$wheel") into $dir/venv"
