#!/usr/bin/env bash
# build-image.sh — build a flashable SD-card image of the voice appliance.
#
# Same approach as Raspberry Pi's rpi-image-gen: mmdebstrap makes an arm64
# Debian root filesystem, genimage assembles the disk (MBR, FAT32 boot
# partition, ext4 root, ext4 data) from directories with mkdosfs/mcopy and
# mke2fs -d. No loop devices and no mounts of the image, so it runs as root in
# an ordinary (non --privileged) container and in CI. See docs/image.md.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PI5_DEBIAN_DIR="$SCRIPT_DIR/firmware-overlay/pi5-debian"
HOST_ARCH=$(dpkg --print-architecture 2>/dev/null || echo unknown)

# --------------------------------------------------------------------------
# Pinned inputs. Models are verified by SHA-256; there is no "skip" switch.
# The hashes are empty on purpose: they could not be computed from the build
# environment this script was written in (the model host was unreachable).
# A builder pins them once, after checking the file page of the model repo
# (the "SHA256" shown for each LFS file), with --model-sha256/--mmproj-sha256
# or the environment variables APPLIANCE_MODEL_SHA256/APPLIANCE_MMPROJ_SHA256,
# and should then commit them here.
MODEL_REPO_URL="https://huggingface.co/ggml-org/gemma-4-E2B-it-GGUF/resolve/main"
MODEL_SRC_NAME="gemma-4-e2b-it-Q4_K_M.gguf"
MMPROJ_SRC_NAME="mmproj-gemma-4-e2b-it-f16.gguf"
MODEL_NAME="gemma-4-E2B-it-Q4_K_M.gguf"          # name on the image
MMPROJ_NAME="mmproj-gemma-4-E2B-it-f16.gguf"     # name on the image
MODEL_SHA256_PINNED=""
MMPROJ_SHA256_PINNED=""
# Raspberry Pi archive signing key (archive.raspberrypi.com).
RPI_KEY_URL="http://archive.raspberrypi.com/debian/raspberrypi.gpg.key"
RPI_KEY_FPR="CF8A1AF502A2AA2D763BAE7E82B129927FA3303E"
# --------------------------------------------------------------------------

VENV=/opt/appliance/venv
TARGET=pi5
VERSION=""
OUT_DIR="$SCRIPT_DIR/out"
CACHE_DIR="${APPLIANCE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/appliance-image}"
WORK_DIR=""
SUITE=trixie
MIRROR="http://deb.debian.org/debian"
SECURITY_MIRROR="http://deb.debian.org/debian-security"
RPI_MIRROR="http://archive.raspberrypi.com/debian"
RPI_KEYRING=""
HAT=none
PI5_KERNEL=rpi
HOSTNAME_=appliance
ADMIN="admin"
SSH_KEY_FILE=""
PASSWORD_HASH=""
PASSWORD_PROMPT=0
WIFI_FILE=""
WHEELHOUSE=""
MODELS_DIR=""
NO_MODELS=0
MODEL_SHA256="${APPLIANCE_MODEL_SHA256:-$MODEL_SHA256_PINNED}"
MMPROJ_SHA256="${APPLIANCE_MMPROJ_SHA256:-$MMPROJ_SHA256_PINNED}"
CONFIG_FILE="$SCRIPT_DIR/config.yaml"
BOOT_SIZE=512M
ROOT_SIZE=""
DATA_SIZE=""
ROOTFS_TAR=""
ARCH=""
SKIP_PYTHON=0
COMPRESS=1
KEEP_WORK=0
ONLY_ROOTFS=0
CHECK_TOOLS_ONLY=0
DISK_SIG=""
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"

usage() {
	cat <<EOF
Usage: ./build-image.sh [options]

Builds out/appliance-<version>[-qemu].img (+ .img.xz, + .img.bmap when
bmaptool is installed) for a Raspberry Pi 5 (default) or for qemu -M virt.
Run as root (a plain container is fine). Downloads are cached in
\$APPLIANCE_IMAGE_CACHE (default ~/.cache/appliance-image); re-running with
the same inputs reuses the cached root filesystem, wheels and models.

Target:
  --target pi5|qemu       pi5: a Raspberry Pi 5 SD card (default)
                          qemu: Debian linux-image-arm64, boots in
                          qemu-system-aarch64 -M virt (kernel/initrd are also
                          written next to the image)
  --pi5-kernel rpi|debian kernel of the pi5 target (default: rpi)
                          rpi: linux-image-rpi-2712 from the Raspberry Pi
                          archive (16K pages; I2S HAT overlays, fan control)
                          debian: linux-image-arm64 from \${SUITE}-backports,
                          nothing from the Raspberry Pi archive (4K pages;
                          USB audio only: no HAT overlays, no fan curve)
  --version V             image version (default: from pyproject.toml)
  --out DIR               output directory (default: ./out)
  --cache DIR             download/build cache
  --suite NAME            Debian suite (default: trixie)
  --mirror URL            Debian mirror (default: $MIRROR)
  --rpi-mirror URL        Raspberry Pi archive (default: $RPI_MIRROR)
  --rpi-keyring FILE      Raspberry Pi archive key (default: downloaded and
                          checked against fingerprint $RPI_KEY_FPR)

Hardware:
  --hat NAME              voice HAT overlay in config.txt: none,
                          respeaker-2mic-v1, respeaker-2mic-v2,
                          googlevoicehat, i2s-mems (default: none)

First boot / login (no default password is ever set):
  --hostname NAME         host name, reachable as NAME.local (default: appliance)
  --user NAME             admin login (sudo) user (default: admin)
  --ssh-key FILE          authorized_keys for the admin user; SSH password
                          login is then disabled
  --password              prompt for the admin password (or read it from
                          \$APPLIANCE_PASSWORD); stored as a SHA-512 crypt hash
  --password-hash HASH    admin password as a crypt(3) hash (openssl passwd -6)
  --wifi-file FILE        put FILE on the boot partition as appliance-wifi.txt
                          (ssid=/psk=/country= lines, applied at first boot)
  Without --ssh-key/--password the admin account is locked until a
  userconf.txt or authorized_keys is put on the boot partition.

Python and models:
  --wheelhouse DIR        extra wheels (e.g. a prebuilt llama-cpp-python for
                          linux_aarch64/cp313); preferred over PyPI
  --models-dir DIR        take $MODEL_NAME and $MMPROJ_NAME
                          from DIR instead of downloading (still hash-checked)
  --model-sha256 HEX      SHA-256 of $MODEL_NAME
  --mmproj-sha256 HEX     SHA-256 of $MMPROJ_NAME
  --no-models             build without models: the appliance boots into its
                          "no model" state (LED, journal, appliance doctor)
  --config FILE           appliance config (default: ./config.yaml)

Layout:
  --boot-size SIZE        FAT32 boot partition (default: $BOOT_SIZE)
  --root-size SIZE        ext4 root (default: 5G pi5, 4G qemu)
  --data-size SIZE        initial ext4 data partition; grown to the card at
                          first boot (default: models + 512M)

Testing / advanced:
  --rootfs-tar FILE       use FILE as the base root (a tarball made by
                          mmdebstrap) instead of running mmdebstrap
  --arch ARCH             root architecture (default arm64; amd64 only with
                          --rootfs-tar, for fast CI structure checks)
  --skip-python           no Python environment (structure tests only: the
                          image gets a stub 'appliance' that says so)
  --disk-signature HEX    MBR disk signature (default: random, recorded)
  --no-compress           do not write .img.xz
  --keep-work             keep the work directory
  --only-rootfs           only build (or find cached) the base root tarball
  --check-tools           only check that every tool this build needs is
                          installed (one line naming the missing ones)
  -h, --help              this help

Expected time (x86-64 builder, 2 cores, cold cache): about 1 hour — base
root under emulation ~30 min, llama-cpp-python cross-compiled ~20 min (with
gcc-aarch64-linux-gnu; 1-2 h under emulation without it), Python install
~8 min; warm cache ~8-10 min. Pi 5 image ~9.5 GiB raw with models (sparse),
~4.5-5 GB .xz; needs a 16 GB card. See docs/image.md.
EOF
}

die() { echo "build-image.sh: error: $*" >&2; exit 1; }
# Bad input (an option, a file given on the command line, a missing tool): one line, exit 2.
bad() { echo "build-image.sh: error: $*" >&2; exit 2; }
log() { echo "==> $*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || die "missing tool '$1' (Debian package: $2)"; }

while [ $# -gt 0 ]; do
	case "$1" in
		-h|--help) usage; exit 0 ;;
		--target) TARGET=${2:?}; shift ;;
		--version) VERSION=${2:?}; shift ;;
		--out) OUT_DIR=${2:?}; shift ;;
		--cache) CACHE_DIR=${2:?}; shift ;;
		--work) WORK_DIR=${2:?}; shift ;;
		--suite) SUITE=${2:?}; shift ;;
		--mirror) MIRROR=${2:?}; shift ;;
		--security-mirror) SECURITY_MIRROR=${2:?}; shift ;;
		--rpi-mirror) RPI_MIRROR=${2:?}; shift ;;
		--rpi-keyring) RPI_KEYRING=${2:?}; shift ;;
		--hat) HAT=${2:?}; shift ;;
		--pi5-kernel) PI5_KERNEL=${2:?}; shift ;;
		--hostname) HOSTNAME_=${2:?}; shift ;;
		--user) ADMIN=${2:?}; shift ;;
		--ssh-key) SSH_KEY_FILE=${2:?}; shift ;;
		--password) PASSWORD_PROMPT=1 ;;
		--password-hash) PASSWORD_HASH=${2:?}; shift ;;
		--wifi-file) WIFI_FILE=${2:?}; shift ;;
		--wheelhouse) WHEELHOUSE=${2:?}; shift ;;
		--models-dir) MODELS_DIR=${2:?}; shift ;;
		--model-sha256) MODEL_SHA256=${2:?}; shift ;;
		--mmproj-sha256) MMPROJ_SHA256=${2:?}; shift ;;
		--no-models) NO_MODELS=1 ;;
		--config) CONFIG_FILE=${2:?}; shift ;;
		--boot-size) BOOT_SIZE=${2:?}; shift ;;
		--root-size) ROOT_SIZE=${2:?}; shift ;;
		--data-size) DATA_SIZE=${2:?}; shift ;;
		--rootfs-tar) ROOTFS_TAR=${2:?}; shift ;;
		--arch) ARCH=${2:?}; shift ;;
		--skip-python) SKIP_PYTHON=1 ;;
		--disk-signature) DISK_SIG=${2:?}; shift ;;
		--no-compress) COMPRESS=0 ;;
		--keep-work) KEEP_WORK=1 ;;
		--only-rootfs) ONLY_ROOTFS=1 ;;
		--check-tools) CHECK_TOOLS_ONLY=1 ;;
		*) die "unknown option '$1' (see --help)" ;;
	esac
	shift
done

# ---------------------------------------------------------------- validation
# Every check on the command line comes before any build step; each failure
# is one line naming the option and the fix, exit status 2.
case "$TARGET" in pi5|qemu) ;; *) bad "--target must be pi5 or qemu, not '$TARGET'" ;; esac
case "$PI5_KERNEL" in rpi|debian) ;; *) bad "--pi5-kernel must be rpi or debian, not '$PI5_KERNEL'" ;; esac
ARCH=${ARCH:-arm64}
if [ "$ARCH" != arm64 ] && [ -z "$ROOTFS_TAR" ]; then
	bad "--arch $ARCH is only for structure tests with --rootfs-tar (the appliance runs on arm64)"
fi
grep -qE "^${HAT}[[:space:]]" "$SCRIPT_DIR/firmware-overlay/hats.list" ||
	bad "unknown --hat '$HAT' (known: $(grep -v '^#' "$SCRIPT_DIR/firmware-overlay/hats.list" | awk '{print $1}' | tr '\n' ' '))"
if [ "$TARGET" = pi5 ] && [ "$PI5_KERNEL" = debian ] && [ "$HAT" != none ]; then
	bad "--hat $HAT needs the Raspberry Pi kernel (Debian's kernel has no I2S sound-card overlays for voice HATs): use --pi5-kernel rpi, or --hat none with a USB sound card"
fi
[[ "$HOSTNAME_" =~ ^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$ ]] || bad "invalid --hostname '$HOSTNAME_' (lower-case letters, digits and inner hyphens, at most 63)"
# useradd's rule (shadow's default NAME_REGEX, 32 characters at most), minus
# the names Debian gives system accounts; the root itself is checked again
# in setup_users (an existing account with a system UID is refused).
[[ "$ADMIN" =~ ^[a-z_][a-z0-9_-]{0,31}$ ]] || bad "invalid --user '$ADMIN' (useradd's rule: a lower-case letter or _, then letters, digits, _ or -, at most 32)"
case "$ADMIN" in
	root|appliance|daemon|bin|sys|sync|games|man|lp|mail|news|uucp|proxy|www-data|backup|list|irc|gnats|nobody|_apt|messagebus|sshd|avahi|polkitd|tss|systemd-*|dnsmasq|nm-openvpn|usbmux|pulse|rtkit|sudo|adm|audio|gpio|video|plugdev|netdev|staff|users|input|render|kmem|dialout|disk|tty)
		bad "--user may not be '$ADMIN' (a system account or group); pick a personal login name" ;;
esac
[ -z "$SSH_KEY_FILE" ] || [ -r "$SSH_KEY_FILE" ] || bad "--ssh-key $SSH_KEY_FILE: file not found"
[ -z "$SSH_KEY_FILE" ] || grep -qE '^(ssh-|ecdsa-|sk-)' "$SSH_KEY_FILE" || bad "--ssh-key $SSH_KEY_FILE holds no public key (expected a line starting ssh-, ecdsa- or sk-)"
[ -z "$WIFI_FILE" ] || [ -r "$WIFI_FILE" ] || bad "--wifi-file $WIFI_FILE: file not found"
if [ -n "$WIFI_FILE" ]; then
	# The device's own parser (systemd/appliance-firstboot): the same rules
	# the card applies at first boot, checked before building.
	wifi_why=$(APPLIANCE_ISO3166=${APPLIANCE_ISO3166:-/usr/share/iso-codes/json/iso_3166-1.json} \
		bash "$SCRIPT_DIR/systemd/appliance-firstboot" --check-wifi "$WIFI_FILE" 2>&1) ||
		bad "--wifi-file ${wifi_why:-$WIFI_FILE: invalid} (see firmware-overlay/appliance-wifi.txt.example; country= needs the iso-codes package)"
fi
[ -f "$CONFIG_FILE" ] || bad "config file $CONFIG_FILE not found (--config)"
[ "$(id -u)" = 0 ] || bad "run as root (in a container is fine: no loop devices or mounts of the image are used)"
if [ -n "$PASSWORD_HASH" ] && [[ "$PASSWORD_HASH" != \$* ]]; then bad "--password-hash must be a crypt hash (openssl passwd -6)"; fi
if [ $NO_MODELS = 1 ] && [ -n "$MODELS_DIR" ]; then bad "--no-models and --models-dir exclude each other"; fi

if [ -z "$VERSION" ]; then
	VERSION=$(sed -nE 's/^version[[:space:]]*=[[:space:]]*"([^"]+)".*/\1/p' "$SCRIPT_DIR/pyproject.toml" 2>/dev/null | head -n1)
	VERSION=${VERSION:-$(git -C "$SCRIPT_DIR" describe --tags --always 2>/dev/null || echo 0.0.0)}
fi
NAME="appliance-$VERSION"; [ "$TARGET" = qemu ] && NAME="$NAME-qemu"
if [ "$TARGET" = pi5 ] && [ "$PI5_KERNEL" = debian ]; then NAME="$NAME-debian-kernel"; fi
if [ -z "$ROOT_SIZE" ]; then ROOT_SIZE=$([ "$TARGET" = pi5 ] && echo 5G || echo 4G); fi

# Every tool the whole build will need, checked now (a missing one used to
# surface only after a 17-minute root build). One line lists all of them.
check_tools() {
	local t missing=() pkgs=() foreign=0
	[ "$ARCH" = "$HOST_ARCH" ] || [ "$ARCH" != arm64 ] || foreign=1
	local list="genimage:genimage mkdosfs:dosfstools mcopy:mtools mdir:mtools mke2fs:e2fsprogs sfdisk:fdisk sha256sum:coreutils python3:python3"
	[ -n "$ROOTFS_TAR" ] || list="$list mmdebstrap:mmdebstrap"
	[ -n "$ROOTFS_TAR" ] || [ $foreign = 0 ] || list="$list arch-test:arch-test qemu-aarch64-static:qemu-user-static update-binfmts:binfmt-support"
	[ $COMPRESS = 0 ] || list="$list xz:xz-utils"
	[ $PASSWORD_PROMPT = 0 ] || list="$list openssl:openssl"
	[ $NO_MODELS = 1 ] || [ -n "$MODELS_DIR" ] || list="$list curl:curl"
	if [ "$TARGET" = pi5 ] && [ -z "$ROOTFS_TAR" ] && [ "$PI5_KERNEL" = rpi ] && [ -z "$RPI_KEYRING" ]; then list="$list curl:curl gpg:gpg"; fi
	# The Pi 5 boot-partition check at the end of every Pi 5 build.
	[ "$TARGET" != pi5 ] || list="$list dtc:device-tree-compiler lsinitramfs:initramfs-tools-core zstd:zstd"
	for t in $list; do
		command -v "${t%%:*}" >/dev/null 2>&1 && continue
		missing+=("${t%%:*}"); pkgs+=("${t#*:}")
	done
	# Not commands, but needed all the same.
	if [ $SKIP_PYTHON = 0 ] && command -v python3 >/dev/null && ! python3 -c 'import pip' 2>/dev/null; then
		missing+=("python3-pip"); pkgs+=("python3-pip")
	fi
	if [ $SKIP_PYTHON = 0 ] && [ "$HOST_ARCH" = amd64 ] && [ "$ARCH" = arm64 ] && command -v aarch64-linux-gnu-g++ >/dev/null &&
		command -v python3 >/dev/null && ! python3 -c 'import ensurepip' 2>/dev/null; then
		missing+=("python3-venv"); pkgs+=("python3-venv")  # the llama-cpp-python cross-build's tool venv
	fi
	if [ -z "$ROOTFS_TAR" ] && [ ! -r /usr/share/keyrings/debian-archive-keyring.gpg ]; then
		missing+=("debian-archive-keyring.gpg"); pkgs+=("debian-archive-keyring")
	fi
	[ ${#missing[@]} = 0 ] ||
		bad "missing tools: ${missing[*]} — install them first: apt-get install $(printf '%s\n' "${pkgs[@]}" | sort -u | tr '\n' ' ')(see docs/image.md)"
	if [ $foreign = 1 ] && [ -z "$ROOTFS_TAR" ] && [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && ! arch-test arm64 >/dev/null 2>&1; then
		bad "arch-test arm64 fails: this machine cannot run arm64 programs (enable the qemu-aarch64 binfmt handler: update-binfmts --enable qemu-aarch64)"
	fi
}
check_tools
if [ $CHECK_TOOLS_ONLY = 1 ]; then echo "build-image.sh: every tool for this build is installed" >&2; exit 0; fi

mkdir -p "$OUT_DIR" "$CACHE_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd); CACHE_DIR=$(cd "$CACHE_DIR" && pwd)
WORK_DIR=${WORK_DIR:-$OUT_DIR/work-$TARGET}
ROOT="$WORK_DIR/rootfs"; BOOTP="$WORK_DIR/boot"; DATAP="$WORK_DIR/data"

# -------------------------------------------------- foreign-arch emulation
ensure_emulation() {
	[ "$ARCH" = "$HOST_ARCH" ] && return 0
	[ "$ARCH" = arm64 ] || return 0
	need qemu-aarch64-static qemu-user-static
	if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
		mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null ||
			die "binfmt_misc is not mounted and cannot be (run once on the host: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc)"
	fi
	if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
		command -v update-binfmts >/dev/null || die "qemu-aarch64 binfmt handler missing (install binfmt-support)"
		update-binfmts --enable qemu-aarch64 || die "cannot register the qemu-aarch64 binfmt handler"
	fi
	grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || die "qemu-aarch64 binfmt handler is disabled"
}

# ------------------------------------------------------------------ models
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

fetch_models() {
	MODEL_FILES=()
	[ $NO_MODELS = 1 ] && { log "building WITHOUT models (--no-models)"; return 0; }
	local pairs=("$MODEL_NAME|$MODEL_SRC_NAME|$MODEL_SHA256|--model-sha256" "$MMPROJ_NAME|$MMPROJ_SRC_NAME|$MMPROJ_SHA256|--mmproj-sha256")
	local p name src want opt f got
	mkdir -p "$CACHE_DIR/models"
	for p in "${pairs[@]}"; do
		IFS='|' read -r name src want opt <<<"$p"
		want=$(echo "$want" | tr 'A-F' 'a-f')
		if [ -n "$MODELS_DIR" ]; then
			f="$MODELS_DIR/$name"; [ -f "$f" ] || f="$MODELS_DIR/$src"
			[ -f "$f" ] || die "$name not found in --models-dir $MODELS_DIR"
			got=$(sha_of "$f")
			[ -n "$want" ] || die "no pinned SHA-256 for $name. $f has SHA-256 $got — if that matches the model card, confirm it with $opt $got"
			[ "$got" = "$want" ] || die "$f: SHA-256 $got, expected $want"
		else
			[[ "$want" =~ ^[0-9a-f]{64}$ ]] ||
				die "no pinned SHA-256 for $name: refusing to download unverified weights. Pass $opt HEX (from the file page of $MODEL_REPO_URL/$src), or --models-dir DIR, or --no-models (see docs/image.md)"
			f="$CACHE_DIR/models/$want.gguf"
			if [ ! -f "$f" ]; then
				need curl curl
				log "downloading $src"
				curl -fL --retry 3 -C - -o "$f.part" "$MODEL_REPO_URL/$src" || die "download of $MODEL_REPO_URL/$src failed"
				got=$(sha_of "$f.part")
				[ "$got" = "$want" ] || { rm -f "$f.part"; die "$src: SHA-256 $got, expected $want"; }
				mv "$f.part" "$f"
			else
				got=$(sha_of "$f"); [ "$got" = "$want" ] || { rm -f "$f"; die "cached $f is corrupt; re-run"; }
			fi
		fi
		MODEL_FILES+=("$f|$name")
	done
}

# ---------------------------------------------------------------- packages
common_packages() {
	cat <<-EOF
	systemd systemd-sysv systemd-timesyncd udev dbus kmod iproute2 iputils-ping
	procps login ca-certificates sudo less nano locales tzdata
	openssh-server avahi-daemon libnss-mdns network-manager
	initramfs-tools cloud-guest-utils fdisk e2fsprogs dosfstools
	python3 python3-venv libportaudio2 libsndfile1 libgomp1 alsa-utils
	nftables iso-codes
	EOF
	case "$TARGET-$PI5_KERNEL" in
		pi5-rpi) echo "raspi-firmware linux-image-rpi-2712 raspberrypi-sys-mods raspberrypi-archive-keyring firmware-brcm80211 wpasupplicant wireless-regdb iw rfkill" ;;
		# Debian's own kernel from backports (trixie's 6.12 lacks the Pi 5's
		# SD controller and RP1); no raspi-firmware: our kernel hook fills
		# /boot/firmware (firmware-overlay/pi5-debian/).
		pi5-debian) echo "linux-image-arm64/$SUITE-backports firmware-brcm80211 wpasupplicant wireless-regdb iw rfkill" ;;
		qemu-*) echo "linux-image-arm64" ;;
	esac
}

rpi_keyring() {
	if [ -n "$RPI_KEYRING" ]; then echo "$RPI_KEYRING"; return; fi
	local k="$CACHE_DIR/keys/raspberrypi-archive.gpg"
	if [ ! -s "$k" ]; then
		need curl curl; need gpg gpg
		mkdir -p "$CACHE_DIR/keys"
		curl -fsSL "$RPI_KEY_URL" -o "$k.asc" || die "cannot download $RPI_KEY_URL (pass --rpi-keyring FILE)"
		local fpr
		fpr=$(gpg --show-keys --with-colons "$k.asc" | awk -F: '/^fpr/{print $10; exit}')
		[ "$fpr" = "$RPI_KEY_FPR" ] || die "Raspberry Pi key fingerprint $fpr != pinned $RPI_KEY_FPR"
		gpg --dearmor <"$k.asc" >"$k"
	fi
	echo "$k"
}

# Base root filesystem: Debian packages, kernel and one initramfs run.
# Cached as a tarball keyed on everything that goes into it.
build_base_rootfs() {
	local pkgs key tar keyring_opts=() sources=()
	pkgs=$(common_packages | tr -s ' \n' '\n' | sort -u | tr '\n' ' ')
	local flavour=$TARGET hooks=()
	[ "$TARGET" != pi5 ] || flavour="pi5-$PI5_KERNEL"
	# (The pi5-debian hooks are not in the key: the image step installs the
	# current ones again and re-runs them, see pi5_debian_boot.)
	key=$(printf '%s\n' "v4" "$flavour" "$ARCH" "$SUITE" "$MIRROR" "$RPI_MIRROR" "$pkgs" | sha256sum | cut -c1-16)
	tar="$CACHE_DIR/rootfs/base-$flavour-$ARCH-$SUITE-$key.tar"
	BASE_TAR=$tar
	if [ -s "$tar" ]; then log "base root filesystem: cached $(basename "$tar")"; return 0; fi
	mkdir -p "$CACHE_DIR/rootfs" "$CACHE_DIR/debs/$ARCH"
	sources=("deb $MIRROR $SUITE main non-free-firmware"
		"deb $MIRROR $SUITE-updates main non-free-firmware"
		"deb $SECURITY_MIRROR $SUITE-security main non-free-firmware")
	keyring_opts=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
	if [ "$flavour" = pi5-rpi ]; then
		keyring_opts+=(--keyring="$(rpi_keyring)")
		sources+=("deb $RPI_MIRROR $SUITE main")
	fi
	if [ "$flavour" = pi5-debian ]; then
		sources+=("deb $MIRROR $SUITE-backports main non-free-firmware")
		# Before the kernel package installs: its postinst runs our hook,
		# which puts the kernel and device trees on /boot/firmware under the
		# names config.txt uses. The initramfs gets the SD/RP1 modules, and is
		# copied by the initramfs post-update hook when it is built (below).
		hooks=(--essential-hook="mkdir -p \"\$1/etc/kernel/postinst.d\" \"\$1/etc/initramfs/post-update.d\" \"\$1/boot/firmware\""
			--essential-hook="install -m 755 '$PI5_DEBIAN_DIR/kernel-hook' \"\$1/etc/kernel/postinst.d/zz-appliance-pi5-boot\""
			--essential-hook="install -m 755 '$PI5_DEBIAN_DIR/kernel-hook' \"\$1/etc/initramfs/post-update.d/zz-appliance-pi5-boot\""
			--customize-hook="install -D -m 755 '$PI5_DEBIAN_DIR/initramfs-hook' \"\$1/etc/initramfs-tools/hooks/appliance-pi5\"")
	fi
	log "mmdebstrap: $SUITE/$ARCH for $TARGET (cold: ~15-30 min under emulation)"
	local t0=$SECONDS
	# update-initramfs is diverted to a no-op while packages install (the
	# kernel and several triggers would each run it under emulation) and run
	# once at the end, as pi-gen does.
	mmdebstrap --arch="$ARCH" --variant=apt --format=tar \
		"${keyring_opts[@]}" \
		--aptopt='APT::Install-Recommends "false"' \
		--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
		--include="$pkgs" \
		--setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
		--setup-hook="sync-in $CACHE_DIR/debs/$ARCH /var/cache/apt/archives" \
		--essential-hook='chroot "$1" dpkg-divert --quiet --local --rename --add /usr/sbin/update-initramfs' \
		--essential-hook='printf "#!/bin/sh\necho \"update-initramfs: deferred by build-image.sh\" >&2\nexit 0\n" >"$1/usr/sbin/update-initramfs"; chmod 755 "$1/usr/sbin/update-initramfs"' \
		"${hooks[@]}" \
		--customize-hook="sync-out /var/cache/apt/archives $CACHE_DIR/debs/$ARCH" \
		--customize-hook='rm -f "$1/usr/sbin/update-initramfs"; chroot "$1" dpkg-divert --quiet --local --rename --remove /usr/sbin/update-initramfs' \
		--customize-hook='chroot "$1" update-initramfs -c -k all' \
		"$SUITE" "$tar.part" "${sources[@]}" || { rm -f "$tar.part"; die "mmdebstrap failed"; }
	mv "$tar.part" "$tar"
	log "base root filesystem built in $((SECONDS - t0)) s"
}

extract_root() {
	rm -rf "$WORK_DIR"
	mkdir -p "$ROOT" "$BOOTP" "$DATAP"
	log "extracting $(basename "$1")"
	tar --numeric-owner --xattrs --xattrs-include='*' -xpf "$1" -C "$ROOT"
}

in_root() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 "$@"; }

# ------------------------------------------------------------------ python
app_wheel() {
	local d="$WORK_DIR/appwheel"
	mkdir -p "$d"
	need python3 python3
	python3 -m pip wheel --no-deps --no-build-isolation -w "$d" "$SCRIPT_DIR" >/dev/null 2>&1 ||
		python3 -m pip wheel --no-deps -w "$d" "$SCRIPT_DIR" >&2 || die "cannot build the appliance wheel from $SCRIPT_DIR"
	ls "$d"/*.whl | head -n1
}

llama_version() {
	sed -nE 's/.*"llama-cpp-python==([^"]+)".*/\1/p' "$SCRIPT_DIR/pyproject.toml" | head -n1
}

# Cross-compile on an x86-64 builder: llama-cpp-python loads its shared
# libraries with ctypes (no CPython extension), so libllama/libggml/libmtmd
# built with aarch64-linux-gnu-gcc make a valid py3-none-linux_aarch64 wheel.
# ~15-20 min on 2 cores instead of 1-2 h under emulation.
llama_wheel_cross() {
	local out="$1" ver tc tools
	ver=$(llama_version); [ -n "$ver" ] || ver=""
	tc="$WORK_DIR/aarch64-toolchain.cmake"
	mkdir -p "$WORK_DIR/llama-cross"
	cat >"$tc" <<-EOF
	set(CMAKE_SYSTEM_NAME Linux)
	set(CMAKE_SYSTEM_PROCESSOR aarch64)
	set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
	set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
	set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
	set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
	set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
	EOF
	tools="$CACHE_DIR/tools-venv"
	[ -x "$tools/bin/wheel" ] || { python3 -m venv "$tools" && "$tools/bin/pip" -q install wheel; } >&2 || return 1
	log "cross-compiling llama-cpp-python${ver:+ $ver} for aarch64 (Cortex-A76: $LLAMA_CMAKE_ARGS)"
	local t0=$SECONDS
	CMAKE_ARGS="-DCMAKE_TOOLCHAIN_FILE=$tc $LLAMA_CMAKE_ARGS -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON" \
		CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PIP_DISABLE_PIP_VERSION_CHECK=1 \
		"$tools/bin/pip" wheel --no-cache-dir --no-deps --no-binary llama-cpp-python -w "$WORK_DIR/llama-cross" \
		"llama-cpp-python${ver:+==$ver}" >&2 || return 1
	local whl; whl=$(ls "$WORK_DIR"/llama-cross/llama_cpp_python-*.whl | head -n1)
	# The shared libraries must be aarch64 ELF (e_machine 183).
	python3 - "$whl" <<-'EOF' >&2 || return 1
	import sys, zipfile
	z = zipfile.ZipFile(sys.argv[1])
	libs = [n for n in z.namelist() if "/lib/lib" in n and ".so" in n]
	bad = [n for n in libs if int.from_bytes(z.read(n)[18:20], "little") != 183]
	assert libs and not bad, f"not aarch64: {bad or 'no libraries'}"
	print(f"{len(libs)} aarch64 libraries in {sys.argv[1]}")
	EOF
	"$tools/bin/wheel" tags --remove --python-tag py3 --abi-tag none --platform-tag linux_aarch64 "$whl" >&2 || return 1
	cp "$WORK_DIR"/llama-cross/llama_cpp_python-*-py3-none-linux_aarch64.whl "$out/"
	log "llama-cpp-python cross-compiled in $((SECONDS - t0)) s"
}

# llama-cpp-python has no aarch64 wheel on PyPI. Order: --wheelhouse, cache,
# cross-compile (x86-64 builder with gcc-aarch64-linux-gnu), else build in a
# throw-away arm64 chroot (native on arm64; 1-2 h under emulation). Cached.
llama_wheelhouse() {
	local pyver="$1" cache="$CACHE_DIR/wheels/$ARCH"
	mkdir -p "$cache"
	if [ -n "$WHEELHOUSE" ] && ls "$WHEELHOUSE"/llama_cpp_python-*.whl >/dev/null 2>&1; then
		echo "$WHEELHOUSE"; return
	fi
	local ver; ver=$(llama_version)
	if ls "$cache"/llama_cpp_python-"${ver:-}"*.whl >/dev/null 2>&1; then echo "$cache"; return; fi
	if [ "$HOST_ARCH" = amd64 ] && [ "$ARCH" = arm64 ] && command -v aarch64-linux-gnu-g++ >/dev/null && command -v cmake >/dev/null; then
		if llama_wheel_cross "$cache"; then echo "$cache"; return; fi
		log "cross-compilation failed; falling back to a build under emulation"
	fi
	log "building llama-cpp-python for $ARCH/cp$pyver (Cortex-A76 flags) in a scratch chroot — under emulation this takes 1-2 h; cached afterwards"
	local t0=$SECONDS ca; ca=$(host_ca_bundle)
	mmdebstrap --arch="$ARCH" --variant=apt --format=null \
		--keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
		--aptopt='APT::Install-Recommends "false"' \
		--include="build-essential cmake ninja-build python3-dev python3-venv python3-pip ca-certificates" \
		--setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
		--setup-hook="sync-in $CACHE_DIR/debs/$ARCH /var/cache/apt/archives" \
		--customize-hook='cp /etc/resolv.conf "$1/etc/resolv.conf"' \
		--customize-hook="mkdir -p \"\$1/tmp/wh\"; cp '${ca:-/etc/ssl/certs/ca-certificates.crt}' \"\$1/tmp/wh/ca.crt\"" \
		--customize-hook="chroot \"\$1\" env PIP_CERT=/tmp/wh/ca.crt SSL_CERT_FILE=/tmp/wh/ca.crt CMAKE_ARGS='$LLAMA_CMAKE_ARGS' CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) sh -c 'python3 -m venv /b && /b/bin/pip wheel --no-deps -w /wheels llama-cpp-python${ver:+==$ver}'" \
		--customize-hook="sync-out /wheels $cache" \
		"$SUITE" /dev/null "deb $MIRROR $SUITE main" || die "building llama-cpp-python failed; build it on an arm64 machine and pass --wheelhouse DIR"
	log "llama-cpp-python built in $((SECONDS - t0)) s"
	echo "$cache"
}

# lgpio (gpiozero's pin factory on a Pi 5) has no aarch64 wheel on PyPI for
# trixie's Python 3.13 and no Debian package; with --prefer-binary pip would
# take its empty 0.0.0.2 placeholder wheel. So build the real one (statically
# linked with its C library, PYPI=1) once in a scratch arm64 chroot: a few
# minutes under emulation, cached in <cache>/wheels/arm64.
LGPIO_VERSION=0.2.2.0
lgpio_wheelhouse() {
	local cache="$CACHE_DIR/wheels/$ARCH"
	mkdir -p "$cache"
	if [ -n "$WHEELHOUSE" ] && ls "$WHEELHOUSE"/lgpio-"$LGPIO_VERSION"-*.whl >/dev/null 2>&1; then echo "$WHEELHOUSE"; return; fi
	if ls "$cache"/lgpio-"$LGPIO_VERSION"-*.whl >/dev/null 2>&1; then echo "$cache"; return; fi
	log "building lgpio $LGPIO_VERSION for $ARCH in a scratch chroot (a few minutes under emulation; cached afterwards)"
	local t0=$SECONDS ca; ca=$(host_ca_bundle)
	mmdebstrap --arch="$ARCH" --variant=apt --format=null \
		--keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
		--aptopt='APT::Install-Recommends "false"' \
		--include="gcc libc6-dev swig python3-dev python3-venv python3-pip ca-certificates" \
		--setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
		--setup-hook="sync-in $CACHE_DIR/debs/$ARCH /var/cache/apt/archives" \
		--customize-hook='cp /etc/resolv.conf "$1/etc/resolv.conf"' \
		--customize-hook="mkdir -p \"\$1/tmp/wh\"; cp '${ca:-/etc/ssl/certs/ca-certificates.crt}' \"\$1/tmp/wh/ca.crt\"" \
		--customize-hook="chroot \"\$1\" env PIP_CERT=/tmp/wh/ca.crt SSL_CERT_FILE=/tmp/wh/ca.crt PYPI=1 sh -c 'python3 -m venv /b && /b/bin/pip wheel --no-deps --no-binary lgpio -w /wheels lgpio==$LGPIO_VERSION'" \
		--customize-hook="sync-out /wheels $cache" \
		"$SUITE" /dev/null "deb $MIRROR $SUITE main" >&2 || die "building lgpio failed; build it on an arm64 machine (PYPI=1 pip wheel lgpio==$LGPIO_VERSION) and pass --wheelhouse DIR"
	log "lgpio built in $((SECONDS - t0)) s"
	echo "$cache"
}

# CA bundle the builder's own pip trusts (for TLS-intercepting proxies): the
# pip runs inside the chroot use it too; it is removed from the root after.
host_ca_bundle() {
	local f
	for f in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
		[ -n "$f" ] && [ -f "$f" ] && { echo "$f"; return 0; }
	done
	return 0
}

# pip settings passed into the chroot: the CA bundle and http(s) indexes.
chroot_pip_env() {
	echo "PIP_CERT=/tmp/wh/ca.crt"
	# pip >= 24.2 verifies with the system store (truststore), which only
	# SSL_CERT_FILE points at the builder's bundle (a TLS-intercepting proxy).
	echo "SSL_CERT_FILE=/tmp/wh/ca.crt"
	echo "PIP_DISABLE_PIP_VERSION_CHECK=1"
	echo "PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-120}"
	case "${PIP_INDEX_URL:-}" in http*) echo "PIP_INDEX_URL=$PIP_INDEX_URL" ;; esac
}

install_python() {
	if [ $SKIP_PYTHON = 1 ]; then
		log "WARNING: --skip-python: no Python environment (structure-test image, not usable)"
		install -d "$ROOT$VENV/bin"
		printf '#!/bin/sh\necho "appliance: this image was built with --skip-python (test image)" >&2\nexit 1\n' >"$ROOT$VENV/bin/appliance"
		chmod 755 "$ROOT$VENV/bin/appliance"
		return 0
	fi
	local pyver whl llama t0=$SECONDS
	pyver=$(in_root python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")') || die "python3 does not run in the root (emulation?)"
	whl=$(app_wheel)
	llama=""; [ "$ARCH" = arm64 ] && llama=$(llama_wheelhouse "$pyver")
	local lgpio=""; [ "$ARCH" = arm64 ] && [ "$TARGET" = pi5 ] && lgpio=$(lgpio_wheelhouse)
	log "installing the Python environment in $VENV"
	mkdir -p "$ROOT/tmp/wh/app" "$ROOT/tmp/wh/extra" "$ROOT/tmp/pipcache" "$CACHE_DIR/pip"
	cp "$whl" "$ROOT/tmp/wh/app/"
	[ -z "$llama" ] || cp "$llama"/*.whl "$ROOT/tmp/wh/extra/"
	[ -z "$lgpio" ] || cp "$lgpio"/lgpio-*.whl "$ROOT/tmp/wh/extra/"
	[ -z "$WHEELHOUSE" ] || cp "$WHEELHOUSE"/*.whl "$ROOT/tmp/wh/extra/" 2>/dev/null || true
	cp -a "$CACHE_DIR/pip/." "$ROOT/tmp/pipcache/"
	local ca; ca=$(host_ca_bundle)
	if [ -n "$ca" ]; then cp "$ca" "$ROOT/tmp/wh/ca.crt"; else cp "$ROOT/etc/ssl/certs/ca-certificates.crt" "$ROOT/tmp/wh/ca.crt"; fi
	local pipenv=(); mapfile -t pipenv < <(chroot_pip_env)
	local resolv_backup=""
	if [ -e "$ROOT/etc/resolv.conf" ] || [ -L "$ROOT/etc/resolv.conf" ]; then resolv_backup=$(mktemp); cp -P "$ROOT/etc/resolv.conf" "$resolv_backup"; fi
	rm -f "$ROOT/etc/resolv.conf"; cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
	local extra=("lgpio==$LGPIO_VERSION"); [ "$TARGET" = qemu ] && extra=()
	in_root python3 -m venv "$VENV"
	in_root env PIP_CACHE_DIR=/tmp/pipcache "${pipenv[@]}" \
		"$VENV/bin/pip" install --prefer-binary --find-links /tmp/wh/extra \
		"$(ls "$ROOT"/tmp/wh/app/*.whl | sed "s#^$ROOT##")" "${extra[@]}" ||
		die "pip install of the appliance failed"
	in_root env PIP_CACHE_DIR=/tmp/pipcache "${pipenv[@]}" "$VENV/bin/pip" install --no-deps silero-vad 'pipecat-ai==1.14.0' || die "pip install silero-vad pipecat-ai failed"
	local imports="llama_cpp, onnxruntime, numpy, sounddevice, soundfile"
	[ "$TARGET" = qemu ] || imports="$imports, lgpio; lgpio.gpiochip_open"
	in_root "$VENV/bin/python" -c "import $imports" ||
		die "the Python environment does not import its native dependencies"
	cp -a "$ROOT/tmp/pipcache/." "$CACHE_DIR/pip/" 2>/dev/null || true
	rm -rf "$ROOT/tmp/wh" "$ROOT/tmp/pipcache" "$ROOT/root/.cache"
	rm -f "$ROOT/etc/resolv.conf"; [ -z "$resolv_backup" ] || { cp -P "$resolv_backup" "$ROOT/etc/resolv.conf"; rm -f "$resolv_backup"; }
	log "Python environment installed in $((SECONDS - t0)) s"
}

# --------------------------------------------------------------- appliance
setup_users() {
	groupadd -R "$ROOT" -f --system gpio
	groupadd -R "$ROOT" -f --system audio
	grep -q '^appliance:' "$ROOT/etc/passwd" ||
		useradd -R "$ROOT" --system --user-group --no-create-home --home-dir /var/lib/appliance/state \
			--shell /usr/sbin/nologin --groups audio,gpio --comment "voice appliance" appliance
	local groups=() g
	for g in sudo adm audio gpio netdev plugdev video; do grep -q "^$g:" "$ROOT/etc/group" && groups+=("$g"); done
	if ! grep -q "^$ADMIN:" "$ROOT/etc/passwd" && grep -q "^$ADMIN:" "$ROOT/etc/group"; then
		bad "--user $ADMIN clashes with an existing system group in the root; pick another name"
	fi
	local uid0
	uid0=$(awk -F: -v u="$ADMIN" '$1==u{print $3}' "$ROOT/etc/passwd")
	if [ -n "$uid0" ] && { [ "$uid0" -lt 1000 ] || [ "$uid0" -ge 60000 ]; }; then
		bad "--user $ADMIN is a system account in the root (UID $uid0); pick a personal login name"
	fi
	grep -q "^$ADMIN:" "$ROOT/etc/passwd" ||
		useradd -R "$ROOT" --create-home --shell /bin/bash --user-group --groups "$(IFS=,; echo "${groups[*]}")" "$ADMIN"
	# Locked until a password or key is supplied; never a default password.
	usermod -R "$ROOT" -p '!' "$ADMIN"
	usermod -R "$ROOT" -p '*' root
	[ -z "$PASSWORD_HASH" ] || usermod -R "$ROOT" -p "$PASSWORD_HASH" "$ADMIN"
	install -d -m 755 "$ROOT/etc/appliance-image"
	echo "$ADMIN" >"$ROOT/etc/appliance-image/admin-user"
	local home="$ROOT/home/$ADMIN" uid
	uid=$(awk -F: -v u="$ADMIN" '$1==u{print $3":"$4}' "$ROOT/etc/passwd")
	if [ -n "$SSH_KEY_FILE" ]; then
		install -d -m 700 "$home/.ssh"
		grep -E '^(ssh-|ecdsa-|sk-)' "$SSH_KEY_FILE" >"$home/.ssh/authorized_keys"
		chmod 600 "$home/.ssh/authorized_keys"; chown -R "$uid" "$home/.ssh"
	fi
}

install_appliance_files() {
	local sysd="$ROOT/etc/systemd/system"
	install -D -m 644 "$SCRIPT_DIR/systemd/appliance.service" "$sysd/appliance.service"
	install -D -m 644 "$SCRIPT_DIR/systemd/appliance-firstboot.service" "$sysd/appliance-firstboot.service"
	install -D -m 755 "$SCRIPT_DIR/systemd/appliance-firstboot" "$ROOT/usr/lib/appliance/firstboot"
	# A key-only owner can still edit the config and reload (no password).
	install -D -m 440 "$SCRIPT_DIR/systemd/appliance-owner.sudoers" "$ROOT/etc/sudoers.d/appliance-owner"
	# Incoming: SSH and mDNS only.
	install -D -m 644 "$SCRIPT_DIR/systemd/nftables.conf" "$ROOT/etc/nftables.conf"
	[ ! -f "$SCRIPT_DIR/docs/image.md" ] || install -D -m 644 "$SCRIPT_DIR/docs/image.md" "$ROOT/usr/share/doc/appliance/image.md"
	install -D -m 644 "$CONFIG_FILE" "$ROOT/usr/share/appliance/config.yaml.default"
	# Convenience: `appliance` on the admin's PATH (doctor, devices, stats...).
	ln -sf "$VENV/bin/appliance" "$ROOT/usr/local/bin/appliance"

	# The data partition is mounted at /var/lib/appliance; /etc/appliance is a
	# bind mount of its etc/ directory (see fstab). Staged in $DATAP.
	local app_uid app_gid
	app_uid=$(awk -F: '$1=="appliance"{print $3}' "$ROOT/etc/passwd")
	app_gid=$(awk -F: '$1=="appliance"{print $4}' "$ROOT/etc/passwd")
	install -d -m 755 -o 0 -g 0 "$DATAP" "$DATAP/etc" "$DATAP/models"
	install -d -m 750 -o "$app_uid" -g "$app_gid" "$DATAP/state"
	install -m 644 -o 0 -g 0 "$CONFIG_FILE" "$DATAP/etc/config.yaml"
	install -d -m 755 "$ROOT/var/lib/appliance" "$ROOT/etc/appliance"
	local m src name
	for m in "${MODEL_FILES[@]}"; do
		src=${m%%|*}; name=${m#*|}
		log "adding model $name"
		cp --sparse=always "$src" "$DATAP/models/$name"; chmod 644 "$DATAP/models/$name"
	done
	if [ $NO_MODELS = 1 ]; then
		cat >"$DATAP/models/NO_MODELS.txt" <<-EOF
		This image was built with --no-models: the appliance has no language model.
		It runs in its "no model" state (status LED, journal, 'appliance doctor').
		Copy $MODEL_NAME and $MMPROJ_NAME into
		/var/lib/appliance/models/ and run: sudo systemctl restart appliance
		EOF
	fi

	systemctl --root="$ROOT" enable appliance.service appliance-firstboot.service >/dev/null
	local u
	for u in ssh.service avahi-daemon.service NetworkManager.service systemd-timesyncd.service nftables.service; do
		[ -e "$ROOT/lib/systemd/system/$u" ] || [ -e "$ROOT/usr/lib/systemd/system/$u" ] || continue
		systemctl --root="$ROOT" enable "$u" >/dev/null 2>&1 || true
	done
}

configure_system() {
	echo "$HOSTNAME_" >"$ROOT/etc/hostname"
	printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' "$HOSTNAME_" >"$ROOT/etc/hosts"
	local sig=$1
	cat >"$ROOT/etc/fstab" <<-EOF
	# <device>            <mount point>        <type> <options>                               <dump> <pass>
	PARTUUID=$sig-01  /boot/firmware       vfat   defaults,noatime,fmask=0077,dmask=0077,flush  0 2
	PARTUUID=$sig-02  /                    ext4   defaults,noatime,commit=30                    0 1
	# Conversation state, config and models: full data journalling, so a pulled
	# plug loses at most the last uncommitted transaction, never a torn file.
	PARTUUID=$sig-03  /var/lib/appliance   ext4   defaults,noatime,data=journal,commit=5        0 2
	/var/lib/appliance/etc  /etc/appliance  none  bind,x-systemd.requires-mounts-for=/var/lib/appliance  0 0
	tmpfs             /tmp                 tmpfs  defaults,nosuid,nodev,mode=1777,size=256M     0 0
	EOF
	mkdir -p "$ROOT/etc/ssh/sshd_config.d"
	{
		echo "# build-image.sh"
		echo "PermitRootLogin no"
		if [ -n "$SSH_KEY_FILE" ]; then
			echo "PasswordAuthentication no"
			echo "KbdInteractiveAuthentication no"
		fi
	} >"$ROOT/etc/ssh/sshd_config.d/10-appliance.conf"
	# Persistent journal (so "why did it restart" survives a reboot), capped.
	mkdir -p "$ROOT/etc/systemd/journald.conf.d" "$ROOT/var/log/journal"
	printf '[Journal]\nStorage=persistent\nSystemMaxUse=64M\n' >"$ROOT/etc/systemd/journald.conf.d/10-appliance.conf"
	# Runtime apt sources (the build used the same).
	if [ "$TARGET" = pi5 ]; then
		# /dev/gpiochip* to the gpio group (the appliance user is in it), so
		# gpiozero/lgpio reach the header's RP1 chip. raspberrypi-sys-mods
		# does this on the Raspberry Pi kernel; Debian's kernel has nothing.
		install -D -m 644 "$SCRIPT_DIR/firmware-overlay/60-appliance-gpio.rules" "$ROOT/etc/udev/rules.d/60-appliance-gpio.rules"
	fi
	if [ "$TARGET-$PI5_KERNEL" = pi5-rpi ]; then
		cat >"$ROOT/etc/apt/sources.list.d/raspi.sources" <<-EOF
		Types: deb
		URIs: $RPI_MIRROR
		Suites: $SUITE
		Components: main
		Signed-By: /usr/share/keyrings/raspberrypi-archive-keyring.pgp
		EOF
	fi
	cat >"$ROOT/etc/appliance-image/build-info" <<-EOF
	version=$VERSION
	target=$TARGET
	arch=$ARCH
	suite=$SUITE
	hat=$HAT
	pi5_kernel=$([ "$TARGET" = pi5 ] && echo "$PI5_KERNEL" || echo n/a)
	models=$([ $NO_MODELS = 1 ] && echo none || echo "$MODEL_NAME $MMPROJ_NAME")
	python=$([ $SKIP_PYTHON = 1 ] && echo skipped || echo "$VENV")
	built=$(date -u +%Y-%m-%dT%H:%M:%SZ)
	EOF
}

boot_partition() {
	local sig=$1
	# Kernel packages (raspi-firmware hooks) populate /boot/firmware in the root.
	if [ -d "$ROOT/boot/firmware" ]; then
		cp -a "$ROOT/boot/firmware/." "$BOOTP/"
		find "$ROOT/boot/firmware" -mindepth 1 -delete
	fi
	mkdir -p "$ROOT/boot/firmware"
	# Every pi5 build (also the fast tests' fake roots) fills in and checks
	# the boot files here; the whole partition is checked again on the
	# finished image (tools/check-pi5-boot).
	[ "$TARGET" != pi5 ] || pi5_boot_files
	local console=serial0
	[ "$TARGET-$PI5_KERNEL" != pi5-debian ] || console=ttyAMA10
	sed -E -e "s/^#hat=$HAT: //" -e "s/^#kernel=$PI5_KERNEL: //" "$SCRIPT_DIR/firmware-overlay/config.txt" >"$BOOTP/config.txt"
	sed -e "s/@ROOT_PARTUUID@/$sig-02/" -e "s/@CONSOLE@/$console/" "$SCRIPT_DIR/firmware-overlay/cmdline.txt" >"$BOOTP/cmdline.txt"
	install -m 644 "$SCRIPT_DIR/firmware-overlay/APPLIANCE-README.txt" "$BOOTP/APPLIANCE-README.txt"
	install -m 644 "$SCRIPT_DIR/firmware-overlay/appliance-wifi.txt.example" "$BOOTP/appliance-wifi.txt.example"
	[ -z "$WIFI_FILE" ] || install -m 600 "$WIFI_FILE" "$BOOTP/appliance-wifi.txt"
}

# The Pi 5 boots kernel_2712.img + initramfs_2712 + bcm2712*.dtb (+ overlays/
# with the Raspberry Pi kernel) from the FAT partition. The kernel hooks
# (raspi-firmware's, or ours for --pi5-kernel debian) normally put them in
# /boot/firmware of the root; fill in what is missing, then check that every
# file the firmware reads is there.
pi5_newest_kernel() {
	local pat=$1
	find "$ROOT/lib/modules/" -mindepth 1 -maxdepth 1 -name "$pat" -printf '%f\n' 2>/dev/null | sort -V | tail -n1
}

pi5_boot_files() {
	local kver kdir f need=()
	if [ "$PI5_KERNEL" = debian ]; then
		kver=$(pi5_newest_kernel '*-arm64')
		[ -n "$kver" ] || die "no Debian arm64 kernel (/lib/modules/*-arm64) installed in the root"
		pi5_debian_boot "$kver"
		need=(kernel_2712.img initramfs_2712 bcm2712-rpi-5-b.dtb bcm2712-d-rpi-5-b.dtb)
	else
		kver=$(pi5_newest_kernel '*2712*')
		[ -n "$kver" ] || die "no 2712 kernel installed in the root"
		kdir=$(ls -d "$ROOT/usr/lib/linux-image-$kver" 2>/dev/null || true)
		[ -e "$BOOTP/kernel_2712.img" ] || cp "$ROOT/boot/vmlinuz-$kver" "$BOOTP/kernel_2712.img"
		[ -e "$BOOTP/initramfs_2712" ] || cp "$ROOT/boot/initrd.img-$kver" "$BOOTP/initramfs_2712"
		if [ -n "$kdir" ]; then
			local d
			for d in bcm2712-rpi-5-b.dtb bcm2712d0-rpi-5-b.dtb; do
				[ -e "$BOOTP/$d" ] || cp "$(find "$kdir" -name "$d" | head -n1)" "$BOOTP/$d" 2>/dev/null || true
			done
			[ -d "$BOOTP/overlays" ] || { [ -d "$kdir/overlays" ] && cp -r "$kdir/overlays" "$BOOTP/"; } || true
		fi
		# A D0-stepping board loads bcm2712-rpi-5-b.dtb and applies
		# overlays/bcm2712d0.dtbo, found through overlays/overlay_map.dtb.
		need=(kernel_2712.img initramfs_2712 bcm2712-rpi-5-b.dtb overlays/bcm2712d0.dtbo overlays/overlay_map.dtb)
	fi
	for f in "${need[@]}"; do
		[ -e "$BOOTP/$f" ] || die "boot partition lacks $f (--pi5-kernel $PI5_KERNEL: kernel package layout changed?)"
	done
}

# --pi5-kernel debian: install our kernel hooks (again: the cached base root
# may hold older copies) and run them, so the boot partition has the current
# hooks' output. The initramfs is rebuilt when initramfs-tools is there (the
# real root); the fast tests' fake roots bring their own initrd.
pi5_debian_boot() {
	local kver=$1
	local same_initramfs=0
	cmp -s "$PI5_DEBIAN_DIR/initramfs-hook" "$ROOT/etc/initramfs-tools/hooks/appliance-pi5" && same_initramfs=1
	install -D -m 755 "$PI5_DEBIAN_DIR/kernel-hook" "$ROOT/etc/kernel/postinst.d/zz-appliance-pi5-boot"
	install -D -m 755 "$PI5_DEBIAN_DIR/kernel-hook" "$ROOT/etc/initramfs/post-update.d/zz-appliance-pi5-boot"
	install -D -m 755 "$PI5_DEBIAN_DIR/initramfs-hook" "$ROOT/etc/initramfs-tools/hooks/appliance-pi5"
	install -D -m 644 "$PI5_DEBIAN_DIR/apt-preferences" "$ROOT/etc/apt/preferences.d/appliance-kernel-backports"
	sed "s/@SUITE@/$SUITE/g" -i "$ROOT/etc/apt/preferences.d/appliance-kernel-backports"
	mkdir -p "$ROOT/boot/firmware"
	in_root /etc/kernel/postinst.d/zz-appliance-pi5-boot "$kver" >&2 || die "the pi5 kernel hook failed for $kver"
	# The cached base root's initramfs was made with the same hook: reuse it
	# (a rebuild under emulation takes minutes).
	if [ -x "$ROOT/usr/sbin/update-initramfs" ] && { [ $same_initramfs = 0 ] || [ ! -e "$ROOT/boot/initrd.img-$kver" ]; }; then
		log "rebuilding the initramfs for $kver (SD/RP1 modules)"
		in_root update-initramfs -u -k "$kver" >&2 || die "update-initramfs failed for $kver"
	else
		in_root /etc/initramfs/post-update.d/zz-appliance-pi5-boot "$kver" "/boot/initrd.img-$kver" >&2 ||
			die "the pi5 initramfs hook failed for $kver"
	fi
	cp -a "$ROOT/boot/firmware/." "$BOOTP/"
	find "$ROOT/boot/firmware" -mindepth 1 -delete
}

finalize_root() {
	# Every card must get its own identity.
	printf 'uninitialized\n' >"$ROOT/etc/machine-id"
	rm -f "$ROOT/var/lib/dbus/machine-id" "$ROOT/var/lib/systemd/random-seed" "$ROOT"/var/lib/systemd/credential.secret
	rm -f "$ROOT"/etc/ssh/ssh_host_*
	rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/tmp/* "$ROOT"/var/tmp/*
	find "$ROOT/var/log" -type f -exec truncate -s 0 {} + 2>/dev/null || true
	rm -f "$ROOT/etc/resolv.conf"; ln -s ../run/NetworkManager/resolv.conf "$ROOT/etc/resolv.conf"
	# Sizes that must fit the partitions.
	if [ "$TARGET" = qemu ] && [ "$ARCH" = arm64 ] && [ -z "$ROOTFS_TAR" ]; then
		local kver; kver=$(ls "$ROOT/lib/modules" | sort -V | tail -n1)
		cp "$ROOT/boot/vmlinuz-$kver" "$OUT_DIR/$NAME.vmlinuz"
		cp "$ROOT/boot/initrd.img-$kver" "$OUT_DIR/$NAME.initrd"
	fi
}

# ---------------------------------------------------------------- genimage
size_mib() { # "512M"/"4G"/"123" (bytes) -> MiB (rounded up)
	local s=$1
	case "$s" in
		*G) echo $(( ${s%G} * 1024 )) ;; *M) echo "${s%M}" ;; *K|*k) echo $(( (${s%[Kk]} + 1023) / 1024 )) ;;
		*) echo $(( (s + 1048575) / 1048576 )) ;;
	esac
}

write_genimage_cfg() {
	local sig=$1 cfg=$2 data_mib root_mib used
	root_mib=$(size_mib "$ROOT_SIZE")
	used=$(du -s -BM --apparent-size "$ROOT" | cut -dM -f1)
	[ "$used" -lt $(( root_mib * 85 / 100 )) ] ||
		die "root filesystem content is ${used} MiB; --root-size $ROOT_SIZE leaves too little room"
	if [ -n "$DATA_SIZE" ]; then data_mib=$(size_mib "$DATA_SIZE")
	else
		used=$(du -s -BM --apparent-size "$DATAP" | cut -dM -f1)
		data_mib=$(( (used + 512 + 7) / 8 * 8 ))
	fi
	cat >"$cfg" <<-EOF
	# Generated by build-image.sh — do not edit; re-run the script.
	# MBR, partitions aligned to 8 MiB (SD-card erase blocks):
	#   1 boot  FAT32 (0x0c) /boot/firmware  — config.txt, kernel, userconf.txt
	#   2 root  ext4  (0x83) /
	#   3 data  ext4  (0x83) /var/lib/appliance (+ /etc/appliance), grown at first boot
	image boot.vfat {
	  vfat {
	    label = "bootfs"
	    extraargs = "-F 32"
	  }
	  size = $BOOT_SIZE
	  srcpath = "$BOOTP"
	  temporary = true
	}
	image root.ext4 {
	  ext4 {
	    use-mke2fs = true
	    label = "rootfs"
	    extraargs = "-m 2"
	  }
	  size = ${root_mib}M
	  srcpath = "$ROOT"
	  temporary = true
	}
	image data.ext4 {
	  ext4 {
	    use-mke2fs = true
	    label = "data"
	    extraargs = "-m 1"
	  }
	  size = ${data_mib}M
	  srcpath = "$DATAP"
	  temporary = true
	}
	image $NAME.img {
	  hdimage {
	    partition-table-type = "mbr"
	    align = 8M
	    disk-signature = 0x$sig
	  }
	  partition boot {
	    partition-type = 0x0C
	    bootable = true
	    image = "boot.vfat"
	  }
	  partition root {
	    partition-type = 0x83
	    image = "root.ext4"
	  }
	  partition data {
	    partition-type = 0x83
	    image = "data.ext4"
	  }
	}
	EOF
}

run_genimage() {
	local cfg=$1 tmp="$WORK_DIR/genimage-tmp"
	rm -rf "$tmp" "$OUT_DIR/$NAME.img"; mkdir -p "$tmp"
	log "genimage: assembling $NAME.img"
	local t0=$SECONDS
	# The root directory for genimage is unused (each image has srcpath) but required.
	mkdir -p "$WORK_DIR/empty"
	genimage --config "$cfg" --rootpath "$WORK_DIR/empty" --tmppath "$tmp" \
		--inputpath "$WORK_DIR" --outputpath "$OUT_DIR" >&2 || die "genimage failed"
	rm -rf "$tmp"
	log "genimage done in $((SECONDS - t0)) s"
}

# -------------------------------------------------------------------- main
main() {
	local t_start=$SECONDS sig
	if [ $PASSWORD_PROMPT = 1 ]; then
		local pw="${APPLIANCE_PASSWORD:-}" pw2
		if [ -z "$pw" ]; then
			[ -t 0 ] || die "--password needs a terminal or \$APPLIANCE_PASSWORD"
			read -r -s -p "Password for $ADMIN: " pw; echo >&2
			read -r -s -p "Again: " pw2; echo >&2
			[ "$pw" = "$pw2" ] || die "passwords differ"
		fi
		[ ${#pw} -ge 8 ] || die "password must have at least 8 characters"
		need openssl openssl
		PASSWORD_HASH=$(printf '%s' "$pw" | openssl passwd -6 -stdin)
	fi
	if [ -z "$SSH_KEY_FILE" ] && [ -z "$PASSWORD_HASH" ]; then
		log "NOTE: no --ssh-key/--password: the '$ADMIN' account stays locked until userconf.txt or authorized_keys is put on the boot partition"
	fi
	sig=${DISK_SIG:-$(od -An -N4 -tx4 /dev/urandom | tr -d ' \n')}
	sig=$(printf '%08x' "0x${sig#0x}")

	fetch_models            # first: fail fast on missing hashes
	ensure_emulation
	if [ -n "$ROOTFS_TAR" ]; then BASE_TAR=$ROOTFS_TAR; [ -s "$BASE_TAR" ] || die "--rootfs-tar $ROOTFS_TAR not found"
	else build_base_rootfs; fi
	if [ $ONLY_ROOTFS = 1 ]; then log "base root: $BASE_TAR"; return 0; fi
	extract_root "$BASE_TAR"
	setup_users
	install_python
	install_appliance_files
	configure_system "$sig"
	boot_partition "$sig"
	finalize_root
	write_genimage_cfg "$sig" "$WORK_DIR/genimage.cfg"
	cp "$WORK_DIR/genimage.cfg" "$OUT_DIR/$NAME.genimage.cfg"
	run_genimage "$WORK_DIR/genimage.cfg"

	local img="$OUT_DIR/$NAME.img"
	if [ "$TARGET" = pi5 ]; then
		# What the Pi 5 firmware and kernel will read, checked on the finished
		# image (no Pi 5 can be emulated): see tools/check-pi5-boot.
		log "checking the Pi 5 boot partition"
		python3 "$SCRIPT_DIR/tools/check-pi5-boot" "$img" >&2 ||
			die "the Pi 5 boot check failed (lines above): do not flash $img"
	fi
	if command -v bmaptool >/dev/null; then
		bmaptool create -o "$img.bmap" "$img" && log "wrote $img.bmap"
	else
		log "bmaptool not found (Debian: bmap-tools): no .bmap written"
	fi
	if [ $COMPRESS = 1 ]; then
		log "compressing (xz -T0)"
		xz -T0 -3 -k -f "$img"
	fi
	local sums=("$NAME.img"); [ $COMPRESS = 0 ] || sums+=("$NAME.img.xz")
	(cd "$OUT_DIR" && sha256sum "${sums[@]}" >"$NAME.sha256")
	[ $KEEP_WORK = 1 ] || rm -rf "$WORK_DIR"
	log "done in $((SECONDS - t_start)) s: $img ($(du -h --apparent-size "$img" | cut -f1), disk signature $sig)"
}

main
