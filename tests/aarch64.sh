#!/usr/bin/env bash
# Builds the fasthooks wheel for aarch64 (Graviton, Grace) on an x86-64 Debian host: Debian's
# cross compiler, an aarch64 Python 3.11 from Debian's arm64 packages (unpacked, not installed)
# and torch 2.10.0's aarch64 wheel (a CPU build, and the oldest torch the stable-ABI binary
# serves) with the packages the tests import. The extension is built by setup.py, as everywhere,
# with the cross compiler. tests/aarch64_venv.sh installs the wheel, once tagged, for the ISA
# matrix to run under qemu-aarch64. Everything but the wheel lands in DIR:
#   DIR/root  the aarch64 Python      DIR/site  torch and the test packages
# The wheel (linux_aarch64, for auditwheel to tag) lands in WHEELS.
# Without root, apt-get or an x86-64 host it says so and builds nothing.
#
#     bash tests/aarch64.sh DIR PYTHON WHEELS   (PYTHON: the host interpreter with torch)
set -euo pipefail
dir=$(realpath -m "$1")
python=$2
wheels=$(realpath -m "$3")
repo=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "aarch64: $*" >&2; }

if [[ $(uname -m) != x86_64 ]] || [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
	say "needs an x86-64 host with root and apt-get; not built"
	exit 0
fi
# Python's runtime and what its standard library loads.
packages=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev libc6
	zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libstdc++6 libgcc-s1 libgomp1
	libuuid1 libncursesw6 libtinfo6 libreadline8 libdb5.3 libcrypt1 libnsl2 libtirpc3
	libgssapi-krb5-2 libkrb5-3 libk5crypto3 libcom-err2 libkrb5support0 libkeyutils1)
test_packages=(filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec numpy
	pytest iniconfig pluggy packaging pygments)

if [[ ! -f "$dir/root/.ready" ]]; then
	if ! dpkg --print-foreign-architectures | grep -qx arm64; then
		dpkg --add-architecture arm64
	fi
	say "installing the cross compiler and unpacking Debian's arm64 Python"
	apt-get update -q >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++-aarch64-linux-gnu >/dev/null
	rm -rf "$dir/debs" "$dir/root" && mkdir -p "$dir/debs" "$dir/root"
	(cd "$dir/debs" && apt-get download -q "${packages[@]/%/:arm64}" >/dev/null)
	for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$dir/root"; done
	touch "$dir/root/.ready"
fi
if [[ ! -f "$dir/site/.ready" ]]; then
	say "installing torch 2.10.0 (aarch64, CPU) and the test packages"
	rm -rf "$dir/site"
	"$python" -m pip install -q --disable-pip-version-check --target "$dir/site" --no-deps \
		--only-binary=:all: --implementation cp --python-version 3.11 \
		--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
		torch==2.10.0 "${test_packages[@]}" 2>&1 | { grep -v "is neither a file nor a directory" || true; }
	touch "$dir/site/.ready"
fi

say "building the wheel with aarch64-linux-gnu-g++"
rm -rf "$dir/bdist"
# setup.py with the cross compiler, against torch 2.10.0's aarch64 libraries.
(cd "$repo" && CC=aarch64-linux-gnu-gcc CXX=aarch64-linux-gnu-g++ \
	LDSHARED="aarch64-linux-gnu-g++ -shared" \
	CFLAGS="-I$dir/root/usr/include/aarch64-linux-gnu/python3.11" \
	LDFLAGS="-L$dir/site/torch/lib" "$python" setup.py -q build_ext --build-temp "$dir/tmp" \
	bdist_wheel --plat-name linux_aarch64 --bdist-dir "$dir/bdist" -d "$wheels" 2>&1 |
	{ grep -v '^\[' || true; })
wheel=$(ls "$wheels"/fasthooks-*linux_aarch64.whl)
# e_machine of the ELF header: 183 is AArch64.
"$python" -c "import sys, zipfile
zf = zipfile.ZipFile(sys.argv[1])
(so,) = [n for n in zf.namelist() if n.startswith('fasthooks/_C') and n.endswith('.so')]
sys.exit(zf.read(so)[18] != 183)" "$wheel" || {
	say "the extension built is not an aarch64 library"
	exit 1
}
say "built $(basename "$wheel") against torch 2.10.0"
