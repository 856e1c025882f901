#!/usr/bin/env bash
# Build meshnet's image from Debian's packages, then run its smoke test in it.
#
#   deploy/build-image.sh [MODEL.gguf]
#
# 1. mmdebstrap makes a minimal Debian root file system with python3,
#    python3-venv and ca-certificates, and `podman import` makes it the base
#    image ($BASE; kept, and made again only with REBUILD_BASE=1): no image is
#    pulled from a registry.
# 2. `podman build --isolation=chroot` builds deploy/Containerfile on it
#    ($IMAGE), with pip reaching the package index from the build.
# 3. With MODEL.gguf: `buildah run --isolation chroot` runs deploy/smoke_chain.py
#    inside the image (a container from it, removed after), the model and the
#    script bind-mounted read-only: two stages and a gateway answer a prompt.
#    (`podman run` needs setrlimit, which some VMs refuse; buildah run does not.)
#
# Environment: IMAGE (localhost/meshnet:dev), BASE (localhost/meshnet-base:bookworm),
# SUITE (bookworm), EXTRAS (the project's extras, e.g. torch), REBUILD_BASE,
# PIP_CA (a CA bundle for pip inside the build; default: this machine's, when it
# has one, so a TLS-inspecting proxy's CA is trusted there too).
# With Docker instead: docs/kubernetes.md, "The image".
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
IMAGE=${IMAGE:-localhost/meshnet:dev}
BASE=${BASE:-localhost/meshnet-base:bookworm}
SUITE=${SUITE:-bookworm}
EXTRAS=${EXTRAS:-}
PIP_CA=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
MODEL=${1:-}

step() { printf '== %s\n' "$*" >&2; }

for tool in mmdebstrap podman buildah; do
    command -v "$tool" >/dev/null || { echo "build-image.sh: needs $tool (apt-get install $tool)" >&2; exit 2; }
done
if [[ -n "$MODEL" && ! -f "$MODEL" ]]; then
    echo "build-image.sh: no model file $MODEL" >&2
    exit 2
fi

work=$(mktemp -d)
container=
cleanup() {
    [[ -n "$container" ]] && buildah rm "$container" >/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

if [[ -n "${REBUILD_BASE:-}" ]] || ! podman image exists "$BASE"; then
    step "base: mmdebstrap $SUITE (minbase + python3, python3-venv, ca-certificates) -> $BASE"
    start=$SECONDS
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --format=tar "$SUITE" "$work/base.tar"
    podman import --quiet --change 'CMD ["/bin/bash"]' "$work/base.tar" "$BASE" >/dev/null
    step "base: $(du -h "$work/base.tar" | cut -f1) root file system in $((SECONDS - start)) s"
    rm -f "$work/base.tar"
fi

step "image: podman build --isolation=chroot -f deploy/Containerfile -> $IMAGE"
ca=()
if [[ -f "$PIP_CA" ]]; then
    ca=(--volume "$PIP_CA:/run/pip-ca.crt:ro" --build-arg PIP_CERT=/run/pip-ca.crt)
fi
start=$SECONDS
podman build --isolation=chroot --layers=false -f "$here/Containerfile" \
    --build-arg BASE="$BASE" --build-arg EXTRAS="$EXTRAS" "${ca[@]}" -t "$IMAGE" "$root"
step "image: built in $((SECONDS - start)) s, $(podman image inspect --format '{{.Size}}' "$IMAGE" \
    | awk '{printf "%.0f MB", $1 / 1e6}')"

if [[ -z "$MODEL" ]]; then
    step "smoke: skipped (give MODEL.gguf to run it)"
    exit 0
fi
step "smoke: buildah run --isolation chroot: two stages and a gateway in $IMAGE"
container=$(buildah from --quiet "$IMAGE")
name=$(basename "$MODEL")
buildah run --isolation chroot \
    --volume "$(realpath "$MODEL"):/models/$name:ro" \
    --volume "$here/smoke_chain.py:/smoke/smoke_chain.py:ro" \
    "$container" -- /opt/meshnet/bin/python /smoke/smoke_chain.py "/models/$name"
step "smoke: passed"
