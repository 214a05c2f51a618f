# Shared steps of the Quick start scripts: host packages, the Rust toolchain, the build.
# Sourced, not run. Everything is idempotent: a second run only checks.

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export HUTCH_HOME="${HUTCH_HOME:-$HOME/.local/share/hutch}"
# The official Python SDKs the tests and benchmarks drive: the newest on PyPI when last
# checked (README's compatibility paragraph names the range), in a virtualenv of their own.
E2B_PY=2.64.0
E2B_CI_PY=2.11.5
E2B_VENV="$HUTCH_HOME/cache/py-e2b-$E2B_PY-ci-$E2B_CI_PY"
AGENT_TARGET=x86_64-unknown-linux-musl
# The oldest QEMU hutch runs on (docs/ARCHITECTURE.md, "QEMU baseline"); keep in step
# with hutch_vmm::qemu::MIN_VERSION.
QEMU_MIN=8.2
# With their dependencies that must come from the same release (apt does not pick a
# dependency's version from the suite named for the package that needs it).
QEMU_PACKAGES=(qemu-system-x86 qemu-system-common qemu-system-data seabios qemu-utils)
# g++: the fuzz targets' libFuzzer is C++ (scripts/fuzz.sh, run by the test suite).
OTHER_PACKAGES=(mmdebstrap e2fsprogs util-linux uidmap ca-certificates musl-tools python3-venv g++)

step() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Background jobs end with the script however it ends (an error, Ctrl-C): each runs as
# `setsid CMD &` (a process group of its own, so its children go with it) and is
# registered here; a job already waited for is gone, and its kill does nothing.
BACKGROUND_GROUPS=()
end_background() {
  local group
  for group in "${BACKGROUND_GROUPS[@]}"; do
    kill -- -"$group" 2>/dev/null || true
  done
}
trap end_background EXIT

# "10.0.2" from "QEMU emulator version 10.0.2 (Debian ...)" or "qemu-img version 10.0.2 ...".
tool_version() { "$@" --version 2>/dev/null | sed -n '1s/.*version \([0-9][0-9.]*\).*/\1/p'; }
# True when version $1 >= version $2.
version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }
major_minor() { echo "$1" | cut -d. -f1,2; }

os_codename() { (. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}"); }

# The suite QEMU comes from: Debian 12 ships 7.2, too old, so bookworm-backports (10.0);
# later releases carry a new enough QEMU themselves.
qemu_suite() {
  case "$(os_codename)" in
    bookworm) echo bookworm-backports ;;
    *) echo "" ;;
  esac
}

# The URI the host already uses for Debian's bookworm suite (deb822 or one-line form).
debian_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk 'BEGIN { RS = ""; FS = "\n" }
         { uri = ""; ok = 0
           for (i = 1; i <= NF; i++) {
             if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); split($i, u, " "); uri = u[1] }
             if ($i ~ /^Suites:/ && $i ~ /[ \t]bookworm([ \t]|$)/) ok = 1
           }
           if (ok && uri != "") { print uri; exit } }' "$f"
  done | head -n1
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i ~ /:\/\//) { if ($(i + 1) == "bookworm") print $i; break } }' "$f"
  done | head -n1
}

ensure_backports_source() {
  local suite=$1 mirror list=/etc/apt/sources.list.d/hutch-bookworm-backports.sources
  apt-cache policy 2>/dev/null | grep -q " $suite/" && return 0
  [ -f "$list" ] && return 0
  mirror=$(debian_mirror | head -n1)
  [ -n "$mirror" ] || die "hutch needs QEMU $QEMU_MIN or newer, which Debian 12 has in $suite, and no Debian mirror for bookworm was found in /etc/apt to add it from; add $suite to your apt sources, then run this again"
  step "adding $suite from $mirror (QEMU $QEMU_MIN+ for Debian 12)"
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$mirror" "$suite" >"$list"
}

# What is wrong with the host's tools, as one sentence; empty when all is well.
host_problem() {
  local qemu img
  qemu=$(tool_version qemu-system-x86_64)
  img=$(tool_version qemu-img)
  [ -n "$qemu" ] || { echo "qemu-system-x86_64 is missing (package qemu-system-x86)"; return; }
  version_at_least "$qemu" "$QEMU_MIN" || { echo "qemu-system-x86_64 is $qemu, older than the $QEMU_MIN hutch needs"; return; }
  [ -n "$img" ] || { echo "qemu-img is missing (package qemu-utils)"; return; }
  [ "$(major_minor "$img")" = "$(major_minor "$qemu")" ] || { echo "qemu-img is $img but qemu-system-x86_64 is $qemu: they must come from one QEMU release"; return; }
  local tool pkg
  while read -r tool pkg; do
    command -v "$tool" >/dev/null 2>&1 || { echo "$tool is missing (package $pkg)"; return; }
  done <<'EOF'
mkfs.ext4 e2fsprogs
mmdebstrap mmdebstrap
newuidmap uidmap
musl-gcc musl-tools
g++ g++
dpkg-deb dpkg
script bsdutils
EOF
  python3 -c 'import ensurepip, venv' 2>/dev/null || { echo "python3's venv module is missing (package python3-venv)"; return; }
  # hutch fetches the guest kernel with `apt-get download`, which needs package lists.
  apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1 || { echo "apt has no package list with linux-image-cloud-amd64 (run apt-get update)"; return; }
}

ensure_host_packages() {
  local problem suite
  problem=$(host_problem)
  [ -n "$problem" ] || return 0
  [ "$(id -u)" = 0 ] || die "$problem; run this script as root so it can install the Debian packages hutch needs"
  suite=$(qemu_suite)
  [ -z "$suite" ] || ensure_backports_source "$suite"
  # Every QEMU package already installed (an old qemu-system-gui, say) moves to the new
  # release too, or apt would have to remove it.
  local qemu
  mapfile -t qemu < <({ printf '%s\n' "${QEMU_PACKAGES[@]}"; dpkg-query -W -f='${Package} ${Status}\n' 'qemu-*' 2>/dev/null | awk '/install ok installed/ { print $1 }'; } | sort -u)
  [ -z "$suite" ] || qemu=("${qemu[@]/%//$suite}")
  step "installing Debian packages (${problem}): ${qemu[*]} ${OTHER_PACKAGES[*]}"
  apt-get update -qq || die "apt-get update failed (see above); fix the apt sources, then run this again"
  # One transaction, and --no-remove: apt must not resolve a version conflict by
  # removing a package (it once removed qemu-utils 10.0 to install qemu-system-x86 7.2).
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-remove --no-install-recommends "${qemu[@]}" "${OTHER_PACKAGES[@]}" >/dev/null \
    || die "apt-get could not install ${qemu[*]} ${OTHER_PACKAGES[*]} in one transaction (see above); nothing was removed"
  problem=$(host_problem)
  [ -z "$problem" ] || die "after installing the Debian packages, $problem; install QEMU $QEMU_MIN or newer (qemu-system-x86 and qemu-utils from one release) and run this again"
  echo "QEMU $(tool_version qemu-system-x86_64) (qemu-img $(tool_version qemu-img))" >&2
}

# What the tests need beyond hutch's own packages: Debian's OCI registry (the image pull
# tests start their own on loopback), htpasswd for its login, and a static busybox (the
# busybox-only image the template tests build and boot), and openssl for the test CA
# and certificates of the HTTPS hosts whose TLS hutch inspects (tests/networld.py).
TEST_PACKAGES=(docker-registry apache2-utils busybox-static openssl)

# ensure_tools WHAT COMMAND=PACKAGES... : installs from Debian the packages of each
# COMMAND not on PATH (PACKAGES separated by commas), saying they are WHAT.
ensure_tools() {
  local what="$1" missing=() packages=() pair
  shift
  for pair in "$@"; do
    command -v "${pair%%=*}" >/dev/null 2>&1 && continue
    missing+=("${pair%%=*}")
    IFS=, read -r -a more <<<"${pair#*=}"
    packages+=("${more[@]}")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]} ($what); run this as root so it can install ${packages[*]} from Debian"
  step "installing $what from Debian: ${packages[*]}"
  apt-get update -qq || die "apt-get update failed (see above)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null \
    || die "apt-get could not install ${packages[*]} (see above)"
}

ensure_test_packages() {
  command -v docker-registry >/dev/null 2>&1 && command -v htpasswd >/dev/null 2>&1 && [ -x /bin/busybox ] && command -v openssl >/dev/null 2>&1 && return 0
  [ "$(id -u)" = 0 ] || die "the tests need ${TEST_PACKAGES[*]}; run this as root so it can install them"
  step "installing the tests' Debian packages: ${TEST_PACKAGES[*]}"
  apt-get update -qq || die "apt-get update failed (see above)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-remove --no-install-recommends "${TEST_PACKAGES[@]}" >/dev/null \
    || die "apt-get could not install ${TEST_PACKAGES[*]} (see above)"
  # The package starts a system registry on :5000 where systemd runs; the tests start
  # their own, so that one goes.
  systemctl disable --now docker-registry >/dev/null 2>&1 || true
}

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
  fi
  if ! command -v cargo >/dev/null 2>&1; then
    die "hutch is built with Rust (1.80 or newer), and cargo was not found; install it with rustup, then run this again"
  fi
  if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx "$AGENT_TARGET"; then
    step "adding the Rust target $AGENT_TARGET (the guest agent is a static binary)"
    rustup target add "$AGENT_TARGET"
  fi
}

build() {
  # Side by side: the agent is another target and profile (its own directories under
  # target/, so neither cargo waits for the other's lock), and it fills the core the
  # release build leaves idle while it compiles hutch's own crates one after another.
  local log="target/agent-build.log" agent=0 release=0 pid
  mkdir -p target
  step "building hutch (release) and, beside it, its guest agent (agent profile, log: $log)"
  setsid cargo build --profile agent --locked --target "$AGENT_TARGET" -p hutch-agent >"$log" 2>&1 &
  pid=$!
  BACKGROUND_GROUPS+=("$pid")
  cargo build --release --locked -p hutch-cli || release=$?
  wait "$pid" || agent=$?
  if [ "$agent" -ne 0 ]; then
    tail -n 40 "$log" >&2
    die "building the guest agent failed (cargo exited with $agent); its output is above and in $log"
  fi
  [ "$release" -eq 0 ] || die "building hutch failed (cargo exited with $release; see above)"
  grep -h 'Finished' "$log" >&2 || true
}
