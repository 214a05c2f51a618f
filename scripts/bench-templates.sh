#!/usr/bin/env bash
# Template benchmark: a Debian minbase image (mmdebstrap, one ~60 MB gzip layer) in a
# docker-registry on loopback, pulled and turned into something runnable by hutch and,
# in the same run, by skopeo + umoci (the reference). Rounds interleave the two.
# Measures: a cold pull + convert, a second image sharing the base layer, a fully
# cached Dockerfile rebuild, and the first command in a sandbox of the new template.
# Usage: scripts/bench-templates.sh [ROUNDS]   (default 3; method and results:
# docs/BENCHMARKS.md "Templates from images")
source "$(dirname "$0")/lib.sh"
ROUNDS="${1:-3}"
ensure_host_packages
ensure_test_packages
ensure_rust
ensure_tools "the benchmark's reference tools" skopeo=skopeo umoci=umoci mmdebstrap=mmdebstrap mkfs.erofs=erofs-utils
build
HUTCH="$PWD/target/release/hutch"
"$HUTCH" setup --template base >/dev/null

WORK="$(mktemp -d /tmp/hutch-bench-templates.XXXXXX)"
REG_PID=""
cleanup() {
  if [ -n "$REG_PID" ]; then kill "$REG_PID" 2>/dev/null; wait "$REG_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
  return 0
}
trap cleanup EXIT

# The image: cached under $HUTCH_HOME (mmdebstrap downloads from Debian's mirror once).
CACHE="$HUTCH_HOME/cache/bench"
mkdir -p "$CACHE"
if [ ! -f "$CACHE/debian-minbase.tar" ]; then
  step "making a Debian bookworm minbase tree with mmdebstrap (once; cached in $CACHE)"
  # mmdebstrap picks the output format by the name's extension: .tar, even while partial.
  rm -rf "$CACHE/debian-minbase.partial.tar"
  mmdebstrap --variant=minbase --quiet bookworm "$CACHE/debian-minbase.partial.tar" >/dev/null
  mv "$CACHE/debian-minbase.partial.tar" "$CACHE/debian-minbase.tar"
fi
step "building the OCI images (base, and base plus one small layer) with umoci"
cd "$WORK"
umoci init --layout oci >/dev/null
umoci new --image oci:debian >/dev/null
umoci raw add-layer --image oci:debian "$CACHE/debian-minbase.tar" >/dev/null
umoci config --image oci:debian --config.cmd=/bin/bash >/dev/null
mkdir -p extra/opt/app && echo "app layer" >extra/opt/app/version
tar --numeric-owner --owner=0 --group=0 -C extra -cf extra.tar opt
umoci raw add-layer --image oci:debian --tag app extra.tar >/dev/null

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cat >"$WORK/registry.yml" <<Y
version: 0.1
log: {level: error, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $WORK/registry}}
http: {addr: 127.0.0.1:$PORT}
Y
docker-registry serve "$WORK/registry.yml" >"$WORK/registry.log" 2>&1 &
REG_PID=$!
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null || die "docker-registry did not start (see $WORK/registry.log)"
REG="127.0.0.1:$PORT"
skopeo copy --quiet --dest-tls-verify=false oci:oci:debian "docker://$REG/bench/debian:bookworm"
skopeo copy --quiet --dest-tls-verify=false oci:oci:app "docker://$REG/bench/debian:app"
SIZE="$(skopeo inspect --raw --tls-verify=false "docker://$REG/bench/debian:bookworm" | python3 -c 'import json,sys; print(sum(l["size"] for l in json.load(sys.stdin)["layers"]))')"
echo "image: $REG/bench/debian:bookworm, $((SIZE / 1024 / 1024)) MiB compressed"

now() { date +%s.%N; }
elapsed() { python3 -c "print(f'{$2 - $1:.2f}')"; }

# A home per round with the shared kernel and initramfs (built once by setup).
fresh_home() {
  local h="$WORK/home-$1"
  rm -rf "$h" && mkdir -p "$h"
  ln -s "$HUTCH_HOME/kernel" "$h/kernel"
  ln -s "$HUTCH_HOME/initramfs" "$h/initramfs"
  echo "$h"
}

mkdir -p "$WORK/ctx"
cat >"$WORK/ctx/Dockerfile" <<D
FROM $REG/bench/debian:bookworm
ENV APP=/srv/app
WORKDIR /srv/app
COPY hello.txt ./
RUN echo built > built.txt
D
echo "hello" >"$WORK/ctx/hello.txt"

declare -A T
for round in $(seq 1 "$ROUNDS"); do
  step "round $round of $ROUNDS"
  # Reference: skopeo copy to an OCI layout, then umoci unpack (as root: owners kept).
  ref="$WORK/ref-$round"
  rm -rf "$ref" && mkdir -p "$ref"
  t0=$(now)
  skopeo copy --quiet --src-tls-verify=false "docker://$REG/bench/debian:bookworm" "oci:$ref/layout:base"
  umoci unpack --image "$ref/layout:base" "$ref/bundle-base" >/dev/null
  t1=$(now)
  skopeo copy --quiet --src-tls-verify=false "docker://$REG/bench/debian:app" "oci:$ref/layout:app"
  umoci unpack --image "$ref/layout:app" "$ref/bundle-app" >/dev/null
  t2=$(now)
  T[ref_cold]+="$(elapsed "$t0" "$t1") "
  T[ref_second]+="$(elapsed "$t1" "$t2") "
  # The on-disk form: the unpacked base tree as one ext4 (hutch's form, 4 GiB sparse)
  # and as an EROFS image (microsandbox's per-layer form), time and bytes on disk.
  truncate -s 4G "$ref/base.ext4"
  t0=$(now); mkfs.ext4 -q -F -d "$ref/bundle-base/rootfs" "$ref/base.ext4"; t1=$(now)
  mkfs.erofs --quiet "$ref/base.erofs" "$ref/bundle-base/rootfs" >/dev/null; t2=$(now)
  mkfs.erofs --quiet -zlz4hc "$ref/base-lz4.erofs" "$ref/bundle-base/rootfs" >/dev/null; t3=$(now)
  T[form_ext4]+="$(elapsed "$t0" "$t1") "
  T[form_erofs]+="$(elapsed "$t1" "$t2") "
  T[form_erofs_lz4]+="$(elapsed "$t2" "$t3") "
  T[size_ext4]+="$(du -m "$ref/base.ext4" | cut -f1) "
  T[size_erofs]+="$(du -m "$ref/base.erofs" | cut -f1) "
  T[size_erofs_lz4]+="$(du -m "$ref/base-lz4.erofs" | cut -f1) "
  rm -rf "$ref"

  # hutch: pull + convert to a bootable template, cold (an empty cache), then the
  # second image (base layer cached), then a Dockerfile built once and rebuilt.
  home=$(fresh_home "$round")
  t0=$(now)
  HUTCH_HOME="$home" "$HUTCH" template build -t bench-base --from-image "$REG/bench/debian:bookworm" >/dev/null 2>&1 || die "hutch build failed"
  t1=$(now)
  HUTCH_HOME="$home" "$HUTCH" template build -t bench-app --from-image "$REG/bench/debian:app" >/dev/null 2>&1 || die "hutch build of the second image failed"
  t2=$(now)
  HUTCH_HOME="$home" "$HUTCH" template build -t bench-docker "$WORK/ctx" >"$WORK/first.log" 2>&1 || die "the Dockerfile build failed (see $WORK/first.log)"
  t3=$(now)
  HUTCH_HOME="$home" "$HUTCH" template build -t bench-docker "$WORK/ctx" >"$WORK/cached.log" 2>&1 || die "the cached rebuild failed"
  t4=$(now)
  grep -q "2 step(s) cached, 0 run\|3 step(s) cached, 0 run" "$WORK/cached.log" || die "the rebuild was not fully cached: $(cat "$WORK/cached.log")"
  # Image to first command: the first run makes the template's memory snapshot.
  out=$(HUTCH_HOME="$home" "$HUTCH" run --template bench-docker -- cat /srv/app/built.txt 2>/dev/null)
  t5=$(now)
  [ "$out" = "built" ] || die "the sandbox did not see the build's file (got '$out')"
  HUTCH_HOME="$home" "$HUTCH" run --template bench-docker -- true >/dev/null 2>&1
  t6=$(now)
  T[hutch_cold]+="$(elapsed "$t0" "$t1") "
  T[hutch_second]+="$(elapsed "$t1" "$t2") "
  T[hutch_dockerfile]+="$(elapsed "$t2" "$t3") "
  T[hutch_cached]+="$(elapsed "$t3" "$t4") "
  T[hutch_first_run]+="$(elapsed "$t4" "$t5") "
  T[hutch_next_run]+="$(elapsed "$t5" "$t6") "
  rm -rf "$home"
done

median() { python3 -c "import statistics,sys; print(f'{statistics.median(map(float, sys.argv[1:])):.2f}')" $1; }
echo
echo "| measurement (median of $ROUNDS, seconds) | hutch | skopeo + umoci | ratio |"
echo "|---|---|---|---|"
for pair in "cold pull + convert:hutch_cold:ref_cold" "second image sharing the base:hutch_second:ref_second"; do
  IFS=: read -r label h r <<<"$pair"
  hm=$(median "${T[$h]}"); rm_=$(median "${T[$r]}")
  echo "| $label | $hm | $rm_ | $(python3 -c "print(f'{$hm / $rm_:.2f}x')") |"
done
echo "| Dockerfile (COPY + RUN) on the cached base, first build | $(median "${T[hutch_dockerfile]}") | | |"
echo "| the same Dockerfile rebuilt, all CACHED | $(median "${T[hutch_cached]}") | | |"
echo "| first command in a sandbox of the new template (makes its memory snapshot) | $(median "${T[hutch_first_run]}") | | |"
echo "| a later command (restores the snapshot) | $(median "${T[hutch_next_run]}") | | |"
echo
echo "| the base tree as (median of $ROUNDS) | seconds to make | MiB on disk |"
echo "|---|---|---|"
echo "| one ext4 (mkfs.ext4 -d, 4 GiB sparse) | $(median "${T[form_ext4]}") | $(median "${T[size_ext4]}") |"
echo "| EROFS, uncompressed (mkfs.erofs) | $(median "${T[form_erofs]}") | $(median "${T[size_erofs]}") |"
echo "| EROFS, lz4hc | $(median "${T[form_erofs_lz4]}") | $(median "${T[size_erofs_lz4]}") |"
echo
echo "raw: $(for k in "${!T[@]}"; do printf '%s=[%s] ' "$k" "${T[$k]}"; done)"
