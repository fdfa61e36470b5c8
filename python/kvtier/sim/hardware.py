"""Hardware the simulator models: accelerators, copy links and one serving node.

Units: bytes, bytes per second (``_Bps``), floating-point operations per second (``_flops``),
seconds (``_s``). The presets and their sources are data in ``hardware.toml`` (beside this
module): MI355X and H200 accelerators; PCIe, NVMe and NIC links; host and NVMe KV sizes.

Collective model: a ring all-reduce of ``n`` bytes over ``p`` devices costs
``latency_s + 2 * (p - 1) / p * n / bandwidth_Bps`` (Patarasuk & Yuan, 2009).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

from kvtier.options import check_int, check_real

GB = 10**9
HARDWARE_FILE = Path(__file__).with_name("hardware.toml")


def _check_fields(obj: object, min_open: bool, *names: str, max_value: float = math.inf) -> None:
    """Each field must be a finite number >= 0 (> 0 when ``min_open``) and <= ``max_value``."""
    for name in names:
        check_real(f"{type(obj).__name__}.{name}", getattr(obj, name), min_value=0, min_open=min_open,
                   max_value=max_value)


@dataclass(frozen=True)
class Link:
    """One copy path (a direction of PCIe, an NVMe array, a NIC, a CPU copy thread pool).

    A copy job of ``n`` bytes takes ``job_s + latency_s + n / bandwidth_Bps`` seconds. Jobs on
    the same link queue: each holds the link for ``job_s + n / bandwidth_Bps`` (its bytes and
    its fixed per-job work, e.g. a worker thread's hand-off); their latencies overlap.

    Attributes:
        bandwidth_Bps: sustained bytes per second.
        latency_s: seconds per job before the first byte moves (overlaps other jobs).
        job_s: seconds of fixed work per job that does not overlap other jobs.

    Raises:
        ValueError: a bandwidth <= 0 or a negative latency or job time, naming the field.
    """

    bandwidth_Bps: float
    latency_s: float = 0.0
    job_s: float = 0.0

    def __post_init__(self) -> None:
        _check_fields(self, True, "bandwidth_Bps")
        _check_fields(self, False, "latency_s", "job_s")

    def busy_s(self, nbytes: float) -> float:
        """Seconds one job of ``nbytes`` bytes holds the link (other jobs wait that long)."""
        return self.job_s + nbytes / self.bandwidth_Bps

    def copy_s(self, nbytes: float) -> float:
        """Seconds one job of ``nbytes`` bytes takes on an idle link."""
        return self.latency_s + self.busy_s(nbytes)


@dataclass(frozen=True)
class Accelerator:
    """One GPU.

    Attributes:
        name: e.g. ``"MI355X"``.
        hbm_bytes: device memory in bytes.
        hbm_Bps: peak device-memory bandwidth, bytes/s.
        bf16_flops: dense BF16 matrix peak, FLOP/s.
        fp8_flops: dense FP8 matrix peak, FLOP/s.
        interconnect: GPU-to-GPU link used by tensor-parallel all-reduces (per-GPU bus
            bandwidth and per-collective latency).
    """

    name: str
    hbm_bytes: float
    hbm_Bps: float
    bf16_flops: float
    fp8_flops: float
    interconnect: Link

    def __post_init__(self) -> None:
        _check_fields(self, True, "hbm_bytes", "hbm_Bps", "bf16_flops", "fp8_flops")


@dataclass(frozen=True)
class Efficiency:
    """How far real kernels stay from the peaks (all fractions in (0, 1]) plus fixed costs.

    Attributes:
        matrix: fraction of the matrix peak that GEMMs and attention reach when compute-bound.
        memory: fraction of the HBM peak that memory-bound kernels reach.
        layer_overhead_s: fixed seconds per layer per step (kernel launches and
            synchronisation that no roofline term covers).
        step_overhead_s: fixed seconds per step (scheduling, sampling, host work).
    """

    matrix: float = 0.5
    memory: float = 0.8
    layer_overhead_s: float = 60e-6
    step_overhead_s: float = 2e-3

    def __post_init__(self) -> None:
        _check_fields(self, True, "matrix", "memory", max_value=1)
        _check_fields(self, False, "layer_overhead_s", "step_overhead_s")


@dataclass(frozen=True)
class Node:
    """One serving worker: ``num_devices`` accelerators running one model replica with tensor
    parallelism, and the tiers below its HBM.

    MLA keeps one latent KV head, so under tensor parallelism every device holds (and reads)
    the full KV of every sequence: KV capacity is one device's, and a device loads its copy of
    a block over its own host link, all devices in parallel.

    Attributes:
        accelerator: the GPU.
        num_devices: GPUs in the tensor-parallel group.
        host_link: one GPU's PCIe link (each direction).
        disk_link: the node's NVMe array (reads and writes share it).
        network_link: one GPU's NIC (a remote store or a peer worker).
        host_kv_bytes: host DRAM given to the KV tier.
        disk_kv_bytes: NVMe space given to the KV tier.
        hbm_fraction: share of HBM the engine may use (weights + KV + activations), as serving
            engines' static memory fraction.
        activation_reserve_bytes: per-device HBM kept for activations and graphs.
    """

    accelerator: Accelerator
    num_devices: int
    host_link: Link
    disk_link: Link
    network_link: Link
    host_kv_bytes: float
    disk_kv_bytes: float
    hbm_fraction: float = 0.9
    activation_reserve_bytes: float = 8 * GB

    def __post_init__(self) -> None:
        check_int("Node.num_devices", self.num_devices, min_value=1)
        _check_fields(self, True, "hbm_fraction", max_value=1)
        _check_fields(self, False, "host_kv_bytes", "disk_kv_bytes", "activation_reserve_bytes")

    def kv_bytes_per_device(self, weight_bytes: float) -> float:
        """HBM left for KV on one device once ``weight_bytes`` (all devices together) are loaded.

        Raises:
            ValueError: the weights and reserve do not fit.
        """
        per_device = self.accelerator.hbm_bytes * self.hbm_fraction - weight_bytes / self.num_devices
        left = per_device - self.activation_reserve_bytes
        if left <= 0:
            raise ValueError(f"{weight_bytes / GB:.0f} GB of weights over {self.num_devices} x "
                             f"{self.accelerator.name} leave no HBM for KV")
        return left

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds of one ring all-reduce of ``nbytes`` over the tensor-parallel group (0 for one device)."""
        p = self.num_devices
        if p == 1:
            return 0.0
        link = self.accelerator.interconnect
        return link.latency_s + 2 * (p - 1) / p * nbytes / link.bandwidth_Bps


def from_table(cls, table: dict, where: str):
    """``cls(**table)`` for a dataclass ``cls``: its keys checked against the fields, and the value
    of a field whose type is a dataclass built from its own table the same way.

    Raises:
        ValueError: not a table, an unknown or missing field, or a value ``cls`` refuses; the
            message starts with ``where``.
    """
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table, got {table!r}")
    hints, names = typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {names}")
    table = {k: from_table(hints[k], v, f"{where} {k}") if dataclasses.is_dataclass(hints[k])
             and not isinstance(v, hints[k]) else v for k, v in table.items()}
    try:
        return cls(**table)
    except (TypeError, ValueError) as e:  # TypeError: a field missing
        raise ValueError(f"{where}: {e}") from None


def _load(path: Path) -> tuple[dict[str, Accelerator], dict]:
    """The accelerators of ``path`` by name, and its [node] table with its links built."""
    data = tomllib.loads(path.read_text())
    node_table = {k: from_table(Link, v, f"{path.name} [node] {k}") if k.endswith("_link") else v
                  for k, v in data.get("node", {}).items()}
    return {name: from_table(Accelerator, t, f"{path.name} [accelerator.{name}]")
            for name, t in data.get("accelerator", {}).items()}, node_table


ACCELERATORS, _NODE = _load(HARDWARE_FILE)


def node(name: str, num_devices: int = 8) -> Node:
    """``num_devices`` GPUs ``name`` (default: one 8-GPU platform, OCP MI355X or HGX H200) with the
    links and KV tier sizes of ``hardware.toml``'s [node].

    Raises:
        ValueError: an unknown ``name``, listing the known ones.
    """
    if name not in ACCELERATORS:
        raise ValueError(f"--node must be one of {list(ACCELERATORS)}, got {name!r}")
    return from_table(Node, {**_NODE, "accelerator": ACCELERATORS[name], "num_devices": num_devices},
                      f"{HARDWARE_FILE.name} [node] with {num_devices} x {name}")
