"""Cluster DNS for a test's local pods (``support.manifest_pods``).

``support.manifest_pods`` puts this directory on a pod process's
``PYTHONPATH``, so Python imports this module at start-up: the names in
``$POD_DNS_HOSTS`` (JSON, name -> addresses) then resolve to those addresses,
as a Kubernetes Service's name resolves to its pods' addresses. Every other
name goes to the system's resolver. Only ``socket.getaddrinfo`` is wrapped:
the event loops (trio, asyncio) resolve through it.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

_HOSTS: dict[str, list[str]] = json.loads(os.environ.get("POD_DNS_HOSTS", "{}"))
_system_getaddrinfo = socket.getaddrinfo


def _getaddrinfo(
    host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
) -> list[Any]:
    name = host.decode() if isinstance(host, bytes) else host
    if name not in _HOSTS or flags & socket.AI_NUMERICHOST:
        return _system_getaddrinfo(host, port, family, type, proto, flags)
    found: list[Any] = []
    for address in _HOSTS[name]:
        numeric = flags | socket.AI_NUMERICHOST
        found += _system_getaddrinfo(address, port, family, type, proto, numeric)
    if not found:  # a Service with no pod: the name is known, no address
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return found


if _HOSTS:
    socket.getaddrinfo = _getaddrinfo
