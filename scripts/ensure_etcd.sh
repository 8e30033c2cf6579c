#!/usr/bin/env bash
# Install an etcd server binary for the etcd store's tests where it is missing and we can: as root, with apt-get
# (Debian's etcd-server package: /usr/bin/etcd). Quiet; never fails: without etcd those tests skip, naming it.
# On a host running systemd the package also enables its own etcd.service (port 2379); the tests do not use it,
# they start a server of their own on free ports.
if command -v etcd >/dev/null 2>&1 || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  exit 0
fi
echo "[test] installing etcd-server (for the etcd store's tests)" >&2
export DEBIAN_FRONTEND=noninteractive
{ apt-get install -y -q etcd-server || { apt-get update -q && apt-get install -y -q etcd-server; }; } >/dev/null 2>&1 \
  || echo "[test] could not install etcd-server: the etcd store's tests will skip" >&2
exit 0
