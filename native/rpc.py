"""llama.cpp's RPC backend (ggml-rpc): worker endpoints, the handshake probe, the server.

Why ggml-rpc and not a transport of our own: it is the engine llama.cpp (``rpc-server``,
``--rpc``) already uses to split a model's layers across machines; a remote worker then is
just one more ggml device, and every forward, verify window and repair runs unchanged.

The library functions are bound here with ctypes from the built llama-cpp-python
(``libggml-rpc.so`` next to ``libllama.so``). Facts they depend on, from the vendored
llama.cpp (``ggml/src/ggml-rpc``):

* a worker serves ONE client connection at a time (others wait in the listen backlog), so
  a probe that gets no handshake answer within its timeout means "busy", not "dead";
* the client side aborts the whole process (``GGML_ABORT``) when a worker cannot be
  reached or a connection drops, which is why the daemon reaches workers through
  :mod:`meshd.native.rpc_relay` and checks reachability itself before llama.cpp connects;
* the server binds an IPv4 address literal and needs no authentication: anyone who can
  connect can run graphs on the machine and read its memory buffers.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from functools import cache
from pathlib import Path

import attrs

from .errors import WorkerUnreachable
from .llama import ensure_backend, lc

__all__ = [
    "DEFAULT_PORT", "Endpoint", "cpu_device", "free_memory", "hello", "is_loopback",
    "local_accelerators", "local_gpus", "parse_endpoint", "parse_endpoints", "remote_devices",
    "serve_forever",
]

#: llama.cpp's rpc-server default port.
DEFAULT_PORT = 50052
#: ggml-rpc protocol version this build speaks (ggml-rpc.h RPC_PROTO_*_VERSION).
PROTO_MAJOR = 7
PROTO_MINOR = 0
CMD_HELLO = 14
#: transport.h RPC_CONN_CAPS_SIZE: the HELLO request is only these capability bytes.
CONN_CAPS_SIZE = 24
_HELLO_RSP = 4 + CONN_CAPS_SIZE

# ggml_backend_dev_type (ggml-backend.h)
_DEV_CPU = 0
_DEV_GPU = 1
_DEV_IGPU = 2


@attrs.frozen
class Endpoint:
    """A worker's TCP address as ggml-rpc writes it (``host:port``)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str, *, default_port: int | None = None) -> Endpoint:
    """``HOST:PORT`` (or ``HOST`` when ``default_port`` is given); raises ValueError."""
    raw = text.strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"worker address {text!r} must be HOST:PORT")
        host, port_text = raw, str(default_port)
    if not host or any(c in host for c in " /[]:"):
        raise ValueError(f"worker address {text!r}: bad host {host!r} (IPv4 or a host name)")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"worker address {text!r}: port {port_text!r} is not a number") \
            from None
    if not 0 < port < 65536:
        raise ValueError(f"worker address {text!r}: port must be 1-65535")
    return Endpoint(host, port)


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """``HOST:PORT[,HOST:PORT...]``: distinct workers, in order; raises ValueError."""
    items = [parse_endpoint(part) for part in text.split(",") if part.strip()]
    if not items:
        raise ValueError("no worker address given (HOST:PORT[,HOST:PORT...])")
    if len(set(items)) != len(items):
        raise ValueError(f"a worker is listed twice in {text!r}")
    return tuple(items)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# --------------------------------------------------------------------------- probe


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket (ConnectionError if the worker closes)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        buf += chunk
    return bytes(buf)


def hello(endpoint: Endpoint, *, timeout: float = 5.0) -> tuple[int, int, int]:
    """Connect, do ggml-rpc's HELLO handshake, disconnect; returns the worker's protocol
    version. Raises WorkerUnreachable naming the address and why (refused, timed out,
    busy with another client, incompatible version)."""
    where = str(endpoint)
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    except OSError as exc:
        raise WorkerUnreachable(f"cannot reach worker {where}: {exc.strerror or exc}",
                                endpoint=where) from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", CMD_HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            size = struct.unpack("<Q", recv_exact(sock, 8))[0]
            if size != _HELLO_RSP:
                raise WorkerUnreachable(f"worker {where} is not a ggml-rpc server",
                                        endpoint=where)
            major, minor, patch = recv_exact(sock, _HELLO_RSP)[:3]
        except TimeoutError:
            raise WorkerUnreachable(
                f"worker {where} accepted the connection but did not answer within "
                f"{timeout:g} s: it serves one client at a time and is probably busy "
                "with another one", endpoint=where) from None
        except OSError as exc:
            raise WorkerUnreachable(f"worker {where} dropped the handshake: {exc}",
                                    endpoint=where) from None
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise WorkerUnreachable(
            f"worker {where} speaks ggml-rpc {major}.{minor}.{patch}; this build needs "
            f"{PROTO_MAJOR}.{PROTO_MINOR}.x (run the same meshd/llama.cpp on both sides)",
            endpoint=where)
    return major, minor, patch


# --------------------------------------------------------------------------- library


@cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(libggml, libggml-rpc) from the llama-cpp-python that ``lc`` was loaded from."""
    ensure_backend()
    libdir = Path(lc.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(libdir / "libggml.so"))
    rpc = ctypes.CDLL(str(libdir / "libggml-rpc.so"))
    vp = ctypes.c_void_p
    for name, res, args in (
        ("ggml_backend_dev_count", ctypes.c_size_t, []),
        ("ggml_backend_dev_get", vp, [ctypes.c_size_t]),
        ("ggml_backend_dev_type", ctypes.c_int, [vp]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
        ("ggml_backend_dev_backend_reg", vp, [vp]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_reg_dev_count", ctypes.c_size_t, [vp]),
        ("ggml_backend_reg_dev_get", vp, [vp, ctypes.c_size_t]),
        ("ggml_backend_dev_memory", None,
         [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
    ):
        fn = getattr(ggml, name)
        fn.restype, fn.argtypes = res, args
    rpc.ggml_backend_rpc_add_server.restype = vp
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
        ctypes.POINTER(vp)]
    return ggml, rpc


def _local_devices() -> list[int]:
    """The devices llama.cpp's rpc-server offers: accelerators, else the CPU."""
    return local_gpus() or [cpu_device()]


def _is_rpc(dev: int) -> bool:
    ggml, _ = _libs()
    return bool(ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev)) == b"RPC")


def local_gpus() -> list[int]:
    """Local accelerator devices (not RPC, not the CPU), in ggml's order."""
    ggml, _ = _libs()
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        d = ggml.ggml_backend_dev_get(i)
        if ggml.ggml_backend_dev_type(d) == _DEV_GPU and not _is_rpc(d):
            out.append(int(d))
    return out


def local_accelerators() -> list[int]:
    """This machine's accelerators as llama.cpp's default selection picks them:
    discrete GPUs, else integrated ones."""
    ggml, _ = _libs()
    igpus = [int(d) for d in (ggml.ggml_backend_dev_get(i)
                              for i in range(ggml.ggml_backend_dev_count()))
             if ggml.ggml_backend_dev_type(d) == _DEV_IGPU]
    return local_gpus() or igpus


def cpu_device() -> int:
    """This machine's CPU device."""
    ggml, _ = _libs()
    cpu = ggml.ggml_backend_dev_by_type(_DEV_CPU)
    if not cpu:
        raise RuntimeError("llama.cpp has no CPU device")
    return int(cpu)


def free_memory(dev: int) -> int:
    """Free bytes a device reports (a worker's: one round trip); llama.cpp's default
    weight in a layer split. A device that reports nothing counts the host's memory,
    as llama.cpp does."""
    ggml, _ = _libs()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    if free.value == 0 and total.value == 0:
        ggml.ggml_backend_dev_memory(cpu_device(), ctypes.byref(free), ctypes.byref(total))
    return int(free.value)


def serve_forever(endpoint: Endpoint, *, threads: int, cache_dir: str | None) -> None:
    """Run ggml-rpc's server on this thread; returns only if it cannot listen.

    Blocks inside llama.cpp (no Python runs on this thread meanwhile), so the caller
    runs it on a thread of its own and ends the process to stop it.
    """
    _, rpc = _libs()
    devices = _local_devices()
    if not devices:
        raise RuntimeError("no ggml device to offer")
    arr = (ctypes.c_void_p * len(devices))(*devices)
    rpc.ggml_backend_rpc_start_server(
        str(endpoint).encode(), cache_dir.encode() if cache_dir else None, threads,
        len(devices), arr)


def device_names(devices: list[int]) -> list[str]:
    ggml, _ = _libs()
    return [(ggml.ggml_backend_dev_name(d) or b"?").decode() for d in devices]


def remote_devices(endpoint: str) -> list[int]:
    """Register the worker at ``endpoint`` (``ggml_backend_rpc_add_server``) and return
    its devices. llama.cpp connects at once and ABORTS the process if it cannot: probe
    the endpoint with :func:`hello` first."""
    ggml, rpc = _libs()
    reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
    if not reg:
        raise WorkerUnreachable(f"worker {endpoint} offers no device", endpoint=endpoint)
    return [int(ggml.ggml_backend_reg_dev_get(reg, i))
            for i in range(ggml.ggml_backend_reg_dev_count(reg))]
