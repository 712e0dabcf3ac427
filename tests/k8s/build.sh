#!/usr/bin/env bash
# Builds the Kubernetes test lab's binaries into a cache outside the checkout, once per source
# version: kube-apiserver, kube-scheduler and kubectl from Debian bookworm's `kubernetes` source
# package (upstream v1.20 with its vendored dependencies, built with golang-1.19-go), and the
# tests' node agent (tests/k8s/node/main.go, a kubelet stand-in compiled inside that same tree
# against its vendored packages). etcd comes from Debian's etcd-server package.
#
# Usage: tests/k8s/build.sh            prints the cache directory holding bin/ when done
# Env:   FLOTILLA_K8S_CACHE (default /var/cache/flotilla-k8s)
#
# The first run on a machine takes about 10 minutes on 2 cores (9 to 12 measured) and 1.3 GB of disk at peak;
# later runs find the binaries and only rebuild the node agent when its source changed
# (seconds, with the Go build cache kept beside the binaries).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${FLOTILLA_K8S_CACHE:-/var/cache/flotilla-k8s}"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

log() { echo "k8s-lab build: $*" >&2; }

need_pkgs=()
command -v etcd >/dev/null || need_pkgs+=(etcd-server)
[ -x /usr/lib/go-1.19/bin/go ] || need_pkgs+=(golang-1.19-go)
command -v dpkg-source >/dev/null || need_pkgs+=(dpkg-dev)
command -v rsync >/dev/null || need_pkgs+=(rsync)
command -v make >/dev/null || need_pkgs+=(make)
command -v openssl >/dev/null || need_pkgs+=(openssl)
command -v ip >/dev/null || need_pkgs+=(iproute2)
command -v unshare >/dev/null || need_pkgs+=(util-linux)

src_line_present() {
    grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null
}

version=""
if [ -f "$cache/version" ]; then
    version="$(cat "$cache/version")"
fi
if [ -z "$version" ] || [ ! -x "$cache/$version/bin/kube-apiserver" ] \
        || [ ! -x "$cache/$version/bin/kube-scheduler" ] || [ ! -x "$cache/$version/bin/kubectl" ]; then
    fresh=1
else
    fresh=0
fi

if [ "${#need_pkgs[@]}" -gt 0 ] || [ "$fresh" = 1 ]; then
    if ! src_line_present; then
        log "adding a deb-src line for bookworm"
        cat > /etc/apt/sources.list.d/flotilla-k8s-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    log "apt-get update"
    apt-get update -q >&2
fi
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    log "installing ${need_pkgs[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_pkgs[@]}" >&2
fi

export PATH="/usr/lib/go-1.19/bin:$PATH"
export GOPROXY=off CGO_ENABLED=0
export GOCACHE="$cache/gocache" HOME="${HOME:-/root}"

if [ "$fresh" = 1 ]; then
    version="$(apt-cache showsrc kubernetes | awk '/^Version:/ {print $2; exit}')"
    [ -n "$version" ] || { log "no kubernetes source package found"; exit 1; }
    log "building kubernetes $version (about 10 minutes)"
    work="$cache/$version"
    rm -rf "$work"
    mkdir -p "$work/src"
    (cd "$work/src" && apt-get source -q kubernetes >&2)
    tree="$(find "$work/src" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -n1)"
    ln -sfn "$tree" "$work/tree"
    (cd "$tree" && make WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kubectl" >&2)
    mkdir -p "$work/bin"
    for b in kube-apiserver kube-scheduler kubectl; do
        cp "$tree/_output/bin/$b" "$work/bin/$b"
    done
    # the build's intermediate objects are the bulk of the peak: keep the sources (the node
    # agent builds against them) and the Go cache, drop the rest
    rm -rf "$tree/_output/local"
    echo "$version" > "$cache/version"
fi

work="$cache/$version"
tree="$work/tree"
node_src="$here/node/main.go"
sum="$(sha256sum "$node_src" | cut -c1-16)"
if [ ! -x "$work/bin/flotilla-k8s-node-$sum" ]; then
    log "building the node agent ($sum)"
    mkdir -p "$tree/cmd/flotilla-k8s-node"
    cp "$node_src" "$tree/cmd/flotilla-k8s-node/main.go"
    # GOPATH mode with the tree's vendor folder, as the tree's own build does
    gopath="$work/gopath"
    mkdir -p "$gopath/src/k8s.io"
    ln -sfn "$(readlink -f "$tree")" "$gopath/src/k8s.io/kubernetes"
    (cd "$gopath/src/k8s.io/kubernetes" && GOPATH="$gopath" GO111MODULE=off \
        go build -o "$work/bin/flotilla-k8s-node-$sum.tmp" ./cmd/flotilla-k8s-node >&2)
    mv "$work/bin/flotilla-k8s-node-$sum.tmp" "$work/bin/flotilla-k8s-node-$sum"
fi
ln -sfn "flotilla-k8s-node-$sum" "$work/bin/flotilla-k8s-node"
echo "$work"
