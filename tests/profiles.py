"""DeviceProfiles built in code for dispatcher tests (independent of the shipped YAML files)."""
from __future__ import annotations

from dataclasses import replace

from edgellm.device.profile import CpuCluster, DeviceProfile, Gpu, Npu

G = 1e9


def soc(*, bandwidth=34e9, cpu_fp32=38.4 * G, gpu_fp32=500 * G, gpu_int8=None, gpu_transfer=50e-6,
        npu_int8=6e12, buckets=(32, 64, 128, 256), memory=16 * 2**30, l3=3 * 2**20,
        gpu=True, npu=True) -> DeviceProfile:
    """An RK3588-like SoC: 4 big + 4 LITTLE cores, a GPU and an NPU, every figure adjustable."""
    feats = frozenset({"neon", "dotprod", "fp16"})
    big = CpuCluster("big", (4, 5, 6, 7), "cortex-a76", 2.4e9, feats,
                     {"fp32": cpu_fp32, "fp16": 2 * cpu_fp32, "int8": 4 * cpu_fp32}, 65536, 2**19, l3, 1024)
    little = CpuCluster("little", (0, 1, 2, 3), "cortex-a55", 1.8e9, feats,
                        {"fp32": 14.4 * G, "fp16": 28.8 * G, "int8": 57.6 * G}, 32768, 2**17, l3, 530)
    g = Gpu("gpu", "opencl", 4, {"fp32": gpu_fp32, "fp16": 2 * gpu_fp32, **({"int8": gpu_int8} if gpu_int8 else {})},
            bool(gpu_int8), True, 20e-6, gpu_transfer, 16, 64) if gpu else None
    n = Npu("npu", {"int8": npu_int8}, ("CPUExecutionProvider",), None, True, tuple(buckets),
            frozenset({"matmul"}), 300e-6, 100e-6) if npu else None
    return DeviceProfile("test-soc", "Test SoC", memory, bandwidth, (little, big), g, n)


def cpu_only(**kw) -> DeviceProfile:
    return replace(soc(gpu=False, npu=False, **kw), name="test-cpu")
