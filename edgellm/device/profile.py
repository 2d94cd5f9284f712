"""DeviceProfile: what the cost model knows about a machine, parsed once from YAML and validated.

Every physical figure in a profile YAML carries its unit ("51.2 GB/s", "2.84 GHz", "1 MiB",
"20 us", "38.4 GFLOPS"); the dataclasses hold them in SI base units (bytes, bytes/s, Hz, s,
FLOP/s or op/s). device_profiles/README.md documents the schema; profile_yaml reads and writes
it (load_profile, dump_profile, write_profile, parse_quantity are re-exported here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

PRECISIONS = ("fp32", "fp16", "int8", "int4")   # compute precisions a peak may be given for


@dataclass(frozen=True)
class CpuCluster:
    name: str                          # "big", "prime", "little": the profile's own label
    cores: tuple[int, ...]             # logical CPU ids (as in /sys/devices/system/cpu/cpuN)
    microarch: str                     # "cortex-a76", "cortex-x1", or the host's model name
    max_freq_hz: float                 # highest frequency of the cluster's cores
    features: frozenset[str]           # ISA features: neon, dotprod, fp16, i8mm (avx2, fma on x86)
    peak_per_core: Mapping[str, float] # precision -> FLOP/s (op/s for int8) of one core at max_freq
    l1d_bytes: int                     # per core
    l2_bytes: int                      # L2 per core (per cluster where cores share one, e.g. Cortex-A53)
    l3_bytes: int                      # shared last-level cache seen by the cluster; 0 if none
    capacity: int | None = None        # Linux cpu_capacity (1024 = the fastest core), if known

    def peak(self, precision: str) -> float:
        """Cluster peak in FLOP/s for `precision` (all cores); 0 if the cluster has no figure."""
        return self.peak_per_core.get(precision, 0.0) * len(self.cores)


@dataclass(frozen=True)
class Gpu:
    name: str                          # "Mali-G78 MP14"
    api: str                           # "opencl" (the only API edgellm drives)
    compute_units: int                 # shader cores
    peak: Mapping[str, float]          # precision -> FLOP/s of the whole GPU
    int8_dot: bool                     # cl_arm_integer_dot_product (or equivalent) present
    unified_memory: bool               # shares DRAM with the CPU (zero-copy buffers possible)
    launch_overhead_s: float           # host-side cost of one kernel enqueue
    transfer_overhead_s: float         # fixed cost of handing a buffer between CPU and GPU (map, sync)
    warp_width: int                    # threads per warp/quad (16 on Valhall)
    work_group_size: int               # preferred work-group size (a multiple of warp_width)


@dataclass(frozen=True)
class Npu:
    name: str                          # "Exynos 2100 NPU"
    peak: Mapping[str, float]          # precision -> op/s ("int8": 26e12)
    onnx_providers: tuple[str, ...]    # ONNX Runtime execution providers in priority order
    tflite_delegate: str | None        # path/name of the external TFLite delegate library, if any
    static_shapes: bool                # graphs must have fixed shapes (pad to a bucket)
    chunk_buckets: tuple[int, ...]     # token counts graphs are compiled for, ascending
    supported_ops: frozenset[str]      # op kinds it takes ("matmul", ...)
    launch_overhead_s: float           # cost of one graph invocation
    transfer_overhead_s: float         # fixed cost of handing a buffer between CPU and NPU


@dataclass(frozen=True)
class GemmFigure:
    m: int                             # tokens (rows of the activation)
    k: int                             # input width
    n: int                             # output width
    flops: float                       # measured FLOP/s, median of the runs


@dataclass(frozen=True)
class AttentionFigure:
    tokens: int                        # queries of the step (1: decode)
    context: int                       # keys already cached before them
    flops: float                       # ops.attention_flops / measured seconds, median of the runs


@dataclass(frozen=True)
class ElementwiseFigure:
    op: str                            # rmsnorm | rope | swiglu | add
    tokens: int                        # rows of the call
    flops: float                       # ops.elementwise_flops / measured seconds, median of the runs


@dataclass(frozen=True)
class UnitMeasurement:
    precision_flops: Mapping[str, float]   # precision -> FLOP/s at the largest probe shape
    gemm: tuple[GemmFigure, ...]           # fp32 (or the unit's main precision) at a few shapes
    call_overhead_s: float                 # median cost of one tiny op call, Python included
    threads: int                           # threads the unit ran with
    attention: tuple[AttentionFigure, ...] = ()   # causal attention over an f16 KV pool, as the
                                                  # engine runs it on this unit (gather included)
    elementwise: tuple[ElementwiseFigure, ...] = ()   # rmsnorm, rope, swiglu, add, as the engine calls them
    gemm_fp32act: tuple[GemmFigure, ...] = ()     # neon: the same Q4_1 GEMM with fp32 activations
                                                  # (el_matmul_f32act, a precision plan's ask)
    gemv: Mapping[str, float] = field(default_factory=dict)   # neon: one-row FLOP/s by weight format
                                                  # (q4_1, q8_0, ...; weights streaming, no Python)
    gemv_fp32act: Mapping[str, float] = field(default_factory=dict)   # the same, fp32 activations


BUSY_SHARE = 0.1   # others' share of the CPUs above which a profile's figures are flagged (here, not in
                   # probes, whose psutil import load() would carry: ~1.6 MiB resident)


@dataclass(frozen=True)
class Measured:
    date: str                                      # ISO date of the measurement
    tool: str                                      # "edgellm profile 0.1.0 (--quick)"
    memory_read_bandwidth: float                   # bytes/s, large-array reads, all big cores
    clusters: Mapping[str, Mapping[str, float]]    # cluster name -> precision -> FLOP/s (pinned)
    units: Mapping[str, UnitMeasurement] = field(default_factory=dict)  # backend name -> figures
    others_cpu_share: float | None = None          # share of the CPUs other processes used while it
                                                   # measured (None: not recorded); load() warns above
                                                   # BUSY_SHARE: the figures are then the neighbours'


@dataclass(frozen=True)
class DeviceProfile:
    name: str                          # file stem: "rk3588", "host"
    soc: str                           # "Rockchip RK3588"
    memory_total_bytes: int
    memory_bandwidth: float            # bytes/s, theoretical DRAM peak (or measured for host)
    clusters: tuple[CpuCluster, ...]   # in any order; device.topology.select_big picks the big cores
    gpu: Gpu | None
    npu: Npu | None
    measured: Measured | None = None   # present in profiles written by `edgellm profile`
    source: str = ""                   # the file it was read from

    def cluster(self, name: str) -> CpuCluster:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)


_YAML_API = ("parse_quantity", "format_quantity", "load_profile", "list_profiles", "dump_profile",
             "write_profile")


def __getattr__(name: str):
    # Lazy re-export: profile_yaml imports the dataclasses above, so importing it eagerly here
    # would be circular when profile_yaml is imported first.
    if name in _YAML_API:
        from edgellm.device import profile_yaml

        return getattr(profile_yaml, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
