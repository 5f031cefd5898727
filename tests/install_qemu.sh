#!/usr/bin/env bash
# Installs qemu-user 8 or later for the ISA matrix (tests/isa_matrix.py) where it is missing:
# qemu 7.2's AVX2 emulation miscomputes some of the AVX2 kernels, so on Debian 12 (bookworm)
# it comes from bookworm-backports. Without root or apt-get it says so and leaves it.
set -euo pipefail
major() { qemu-x86_64 --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1; }
have=$(major || true)
if [[ -n "$have" && "$have" -ge 8 ]]; then
	exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
	echo "install_qemu: qemu-user >= 8 is missing and cannot be installed here (needs root and apt-get)" >&2
	exit 0
fi
. /etc/os-release
suite=()
if [[ "${VERSION_CODENAME:-}" == bookworm ]]; then
	if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d; then
		# The backports suite from the mirror the machine already uses for bookworm itself.
		mirror=$(grep -rhs -B3 -A3 "bookworm" /etc/apt/sources.list.d/*.sources |
			awk '/^URIs:/ && $2 !~ /security/ { print $2; exit }')
		if [[ -z "$mirror" ]]; then
			echo "install_qemu: no bookworm mirror found in /etc/apt/sources.list.d; qemu-user >= 8 not installed" >&2
			exit 0
		fi
		printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
			"$mirror" /usr/share/keyrings/debian-archive-keyring.gpg \
			>/etc/apt/sources.list.d/bookworm-backports.sources
	fi
	suite=(-t bookworm-backports)
fi
echo "install_qemu: installing qemu-user ${suite[*]}" >&2
apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${suite[@]}" qemu-user >/dev/null
