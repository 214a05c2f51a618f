# Shared steps of the Quick start scripts: host packages, the Rust toolchain, the build.
# Sourced, not run. Everything is idempotent: a second run only checks.

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export HUTCH_HOME="${HUTCH_HOME:-$HOME/.local/share/hutch}"
AGENT_TARGET=x86_64-unknown-linux-musl
HOST_PACKAGES=(qemu-system-x86 qemu-utils mmdebstrap e2fsprogs util-linux ca-certificates musl-tools python3-venv)

step() { printf '\n==> %s\n' "$*" >&2; }

ensure_host_packages() {
  local missing=()
  for p in "${HOST_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # hutch fetches the guest kernel with `apt-get download`, which needs package lists.
  if [ ${#missing[@]} -gt 0 ] || ! apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
      echo "hutch needs these Debian packages: ${missing[*]:-} (and apt lists); run this script as root" >&2
      exit 1
    fi
    step "installing Debian packages: ${missing[*]:-(refreshing package lists)}"
    apt-get update -qq
    [ ${#missing[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
  fi
  if ! command -v cargo >/dev/null 2>&1; then
    echo "hutch is built with Rust (1.80 or newer), and cargo was not found; install it with rustup, then run this again" >&2
    exit 1
  fi
  if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx "$AGENT_TARGET"; then
    step "adding the Rust target $AGENT_TARGET (the guest agent is a static binary)"
    rustup target add "$AGENT_TARGET"
  fi
}

build() {
  step "building hutch and its guest agent"
  cargo build --release --locked -p hutch-cli
  cargo build --profile agent --locked --target "$AGENT_TARGET" -p hutch-agent
}
