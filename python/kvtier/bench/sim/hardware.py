"""Hardware the simulator models: accelerators, copy links and one serving node.

Units: bytes, bytes per second (``_Bps``), floating-point operations per second (``_flops``),
seconds (``_s``). Peak figures are the vendors' dense (no sparsity) matrix rates.

Sources of the presets:

- **MI355X** (AMD Instinct, CDNA 4): 288 GB HBM3E at 8 TB/s; dense matrix peaks 2.5 PFLOP/s
  BF16 and 5.0 PFLOP/s FP8 (AMD product page and CDNA 4 white paper; the ISSCC 2026 paper gives
  256 CUs x 8,192 FP8 FLOP/clock x 2.4 GHz = 5.03 PFLOP/s). Infinity Fabric: 7 links of
  153.6 GB/s per GPU in an 8-GPU platform.
- **H200** (NVIDIA, Hopper): 141 GB HBM3e at 4.8 TB/s; dense 989 TFLOP/s BF16 and 1,979 TFLOP/s
  FP8 (NVIDIA H200 datasheet, sparsity excluded); NVLink 900 GB/s per GPU.
- **Host link**: PCIe Gen5 x16 per GPU, 64 GB/s per direction raw; WORKLOAD.md's ~50 GB/s is
  what a copy reaches, and is used here.
- **NVMe**: four Gen4/Gen5 drives striped, ~6 GB/s each: 24 GB/s per node, ~100 us per I/O
  (vendor sheets of data-centre NVMe drives; an assumption, not a measurement).
- **Network**: one 400 Gb/s NIC per GPU (the MI355X and H200 reference platforms), 50 GB/s
  per GPU, ~10 us per RDMA transfer (an assumption).

Collective model: a ring all-reduce of ``n`` bytes over ``p`` devices costs
``latency_s + 2 * (p - 1) / p * n / bandwidth_Bps`` (Patarasuk & Yuan, 2009).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.options import check_int, check_real

GB = 10**9
TB = 10**12
TIB = 2**40


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


MI355X = Accelerator("MI355X", hbm_bytes=288 * GB, hbm_Bps=8 * TB, bf16_flops=2.5e15, fp8_flops=5.0e15,
                     interconnect=Link(bandwidth_Bps=7 * 153.6 * GB / 2, latency_s=15e-6))
"""AMD Instinct MI355X (sources in the module docstring). All-reduce bus bandwidth: half the
aggregate of 7 x 153.6 GB/s Infinity Fabric links (each link counted once per direction);
15 us per collective (RCCL small-message latency on 8 GPUs, an assumption)."""

H200 = Accelerator("H200", hbm_bytes=141 * GB, hbm_Bps=4.8 * TB, bf16_flops=989e12, fp8_flops=1979e12,
                   interconnect=Link(bandwidth_Bps=450 * GB, latency_s=10e-6))
"""NVIDIA H200 SXM (sources in the module docstring). All-reduce bus bandwidth: 450 GB/s per
direction of NVLink 4; 10 us per collective (NCCL small-message latency, an assumption)."""

ACCELERATORS = {"mi355x": MI355X, "h200": H200}


def node(name: str, num_devices: int = 8) -> Node:
    """``num_devices`` GPUs ``name`` (default: one 8-GPU platform, OCP MI355X or HGX H200) with the
    host, NVMe and NIC links of the module docstring and assumed KV sizes: 1 TiB of host DRAM and
    4 TB of NVMe.

    Raises:
        ValueError: an unknown ``name``, listing the known ones.
    """
    if name not in ACCELERATORS:
        raise ValueError(f"--node must be one of {list(ACCELERATORS)}, got {name!r}")
    return Node(ACCELERATORS[name], num_devices, host_link=Link(50 * GB, latency_s=10e-6),
                disk_link=Link(24 * GB, latency_s=100e-6), network_link=Link(50 * GB, latency_s=10e-6),
                host_kv_bytes=1 * TIB, disk_kv_bytes=4 * TB)
