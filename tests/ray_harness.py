"""Who listens: every listening TCP socket of a process tree (Ray's processes), read from /proc, and whether an
address is loopback (an IPv4-mapped IPv6 one included)."""

from __future__ import annotations

import ipaddress
import os
import socket


def ray_listeners(root_pid: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket owned by root_pid's process tree (Ray's processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = {root_pid}, [root_pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            if kid not in tree:
                tree.add(kid)
                todo.append(kid)
    owner: dict[str, int] = {}  # socket inode -> pid
    for pid in tree:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for row in f:
                cols = row.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state != "0A" or inode not in owner:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)  # little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((socket.inet_ntop(family, raw), int(hex_port, 16), owner[inode]))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
