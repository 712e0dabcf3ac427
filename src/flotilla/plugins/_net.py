"""Which network interface carries an address (for ``GLOO_SOCKET_IFNAME`` and the like).

Communication libraries (gloo, NCCL) pick an interface from the host name by default; on
machines whose host name resolves to 127.0.0.1, or with several NICs, they pick the wrong
one and the ranks cannot connect. Plugins set the interface from the node's own address.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import subprocess
import time

_SIOCGIFADDR = 0x8915
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def interface_for(addr: str) -> str | None:
    """The name of this machine's interface that carries ``addr`` ("lo" for 127.0.0.1).

    ``addr`` may be a host name (resolved once). Returns None when no interface carries it
    (the address is another machine's, or cannot be resolved).
    """
    ip = _parse(addr)
    if ip is None:
        return None
    names = _interface_names()
    if isinstance(ip, ipaddress.IPv4Address):
        for name in names:
            if _ipv4_of(name) == ip:
                return name
    found = _from_ip_command(ip)
    if found is not None:
        return found
    if ip.is_loopback:
        return next((n for n in names if n == "lo"), None)
    return None


def node_ip(addr: str) -> str:
    """``addr`` (the node's pool address) as an IP address, a host name resolved once as
    :func:`interface_for` resolves it: what an engine binds on a machine with several
    interfaces (Ray's ``--node-ip-address`` takes an IP, not a name); ``addr`` itself when
    it cannot be resolved."""
    ip = _parse(addr)
    return str(ip) if ip is not None else addr


def wait_listening(host: str, port: int, timeout: float, interval: float = 0.005) -> bool:
    """Wait until ``host:port`` accepts a TCP connection; whether it did within ``timeout``.

    For the ranks that rendezvous on a store another rank starts: torch's store client
    that finds nobody listening retries after a randomised backoff of up to a second, so
    a rank that is ready before the head's store waits that long after it is up. Probing
    every ``interval`` seconds (a refused connect costs one syscall) lets it connect at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(left, interval)).close()
            return True
        except OSError:
            if left <= 0:
                return False
            time.sleep(interval)


def _parse(addr: str) -> IPAddress | None:
    host = addr.strip().strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        resolved = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        return ipaddress.ip_address(str(resolved).split("%", 1)[0])
    except (OSError, ValueError, IndexError):
        return None


def _interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    """The primary IPv4 address of interface ``name`` (ioctl SIOCGIFADDR), or None."""
    try:
        import fcntl
    except ImportError:  # not on Linux/Unix
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", name.encode()[:15])
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
    except OSError:  # no IPv4 address on this interface
        return None
    return ipaddress.IPv4Address(packed[20:24])


def _from_ip_command(ip: IPAddress) -> str | None:
    """Search every address (secondary IPv4 ones, IPv6) in ``ip -o addr`` output."""
    try:
        out = subprocess.run(
            ["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_ip_addr(out, ip)


def parse_ip_addr(output: str, ip: IPAddress) -> str | None:
    """The interface whose line in ``ip -o addr`` output carries ``ip``, or None."""
    for line in output.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[2] not in ("inet", "inet6"):
            continue
        with contextlib.suppress(ValueError):
            if ipaddress.ip_interface(parts[3]).ip == ip:
                return parts[1].split("@", 1)[0]
    return None
