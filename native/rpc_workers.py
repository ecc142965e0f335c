"""The remote workers one model is split across, and whether they are all still there.

Why a class of its own: splitting a model over workers is a lifecycle, not a flag. At
start every worker is probed (a clear error naming the address, instead of llama.cpp
aborting the process), each gets a fault-isolating relay, and its devices are placed
in front of this machine's in llama.cpp's layer split, so that the model's last layers -
the MTP blocks and the output head - run here (:mod:`meshd.native.placement`). Later a
worker can be lost:
the model's forwards then fail with :class:`WorkerLost` until every worker answers again
and the owner loads the model anew through :meth:`RemoteWorkers.connect`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import WorkerLost
from .placement import Placement
from .rpc import (
    Endpoint,
    cpu_device,
    device_names,
    free_memory,
    hello,
    local_accelerators,
    remote_devices,
)
from .rpc_relay import LinkStats, WorkerLink

__all__ = ["RemoteWorkers"]


class RemoteWorkers:
    """Workers at ``endpoints``; ``tensor_split`` weighs the devices (each worker's
    devices in order, then the local accelerators; default: by free memory); how many
    layers are offloaded is ``Model.load``'s ``n_gpu_layers`` (``--gpu-layers``)."""

    def __init__(self, endpoints: Sequence[Endpoint], *, tensor_split: Sequence[float] = (),
                 probe_timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("no worker given")
        if any(w < 0 for w in tensor_split) or (tensor_split and not any(tensor_split)):
            raise ValueError("tensor split weights must be >= 0 and not all 0")
        self.endpoints = tuple(endpoints)
        self.tensor_split = tuple(float(w) for w in tensor_split)
        self.probe_timeout = probe_timeout
        self._links: list[WorkerLink] = []
        #: Device names in placement order, as llama.cpp logs them.
        self.device_names: list[str] = []

    def connect(self) -> Placement:
        """Probe every worker, open fresh relays and return where the layers go.

        Raises WorkerUnreachable naming the first worker that does not answer. A model
        placed by an earlier call must be freed first: its relays close here.
        """
        for ep in self.endpoints:
            hello(ep, timeout=self.probe_timeout)
        self.close()
        self._links = [WorkerLink(ep) for ep in self.endpoints]
        devices: list[int] = []
        for link in self._links:
            devices += remote_devices(link.local)
        accelerators = local_accelerators()
        devices += accelerators
        if self.tensor_split and len(self.tensor_split) != len(devices):
            raise ValueError(
                f"--tensor-split has {len(self.tensor_split)} weights but there are "
                f"{len(devices)} devices ({', '.join(device_names(devices))})")
        weights = list(self.tensor_split or (float(free_memory(d)) for d in devices))
        cpu_tail = not accelerators
        if cpu_tail:  # this CPU holds the tail (MTP blocks, output head), no trunk share
            devices.append(cpu_device())
            weights.append(0.0)
        self.device_names = device_names(devices)
        return Placement(tuple(devices), tuple(weights), check=self.check, cpu_tail=cpu_tail)

    def close(self) -> None:
        """Close the relays (the model placed through them must be freed first)."""
        for link in self._links:
            link.close()
        self._links = []

    # ------------------------------------------------------------------ health

    @property
    def lost(self) -> list[tuple[str, str]]:
        """(address, reason) of every worker lost since the last connect."""
        return [(str(link.endpoint), link.lost) for link in self._links
                if link.lost is not None]

    @property
    def degraded(self) -> bool:
        return any(link.lost is not None for link in self._links)

    def check(self) -> None:
        """Raise WorkerLost if any worker of the current load was lost."""
        for link in self._links:
            if link.lost is not None:
                raise WorkerLost(
                    f"remote worker {link.endpoint} was lost ({link.lost}); the layers it "
                    "held are gone until it is back and the model is reloaded",
                    endpoint=str(link.endpoint))

    def all_answer(self) -> bool:
        """Whether every worker answers a handshake now (used to decide on a reload).

        Only lost workers are probed: a worker still serving this daemon would not
        answer a second connection."""
        lost = {str(link.endpoint) for link in self._links if link.lost is not None}
        for ep in self.endpoints:
            if str(ep) not in lost:
                continue
            try:
                hello(ep, timeout=self.probe_timeout)
            except Exception:
                return False
        return True

    def stats(self) -> LinkStats:
        """Totals over the current links (round trips, bytes)."""
        out = LinkStats()
        for link in self._links:
            out.requests += link.stats.requests
            out.round_trips += link.stats.round_trips
            out.bytes_sent += link.stats.bytes_sent
            out.bytes_received += link.stats.bytes_received
        return out
