#!/usr/bin/env bash
# Sourced by ray_on_slurm.sh (and its test): which network interface holds an IPv4 address, from `ip -4 -o addr`.
# gloo binds to whatever the hostname resolves to (127.0.1.1 on a stock /etc/hosts) and NCCL picks an interface
# of its own unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name one: every Ray node is started with the
# interface that holds the address Ray uses there.

# iface_of_ip IP: the interface holding IP on this host (empty when none does)
iface_of_ip() {
  ip -4 -o addr show | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'
}
