"""How a result was obtained: device, versions, allocator and math settings, project revision."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench import IMPORT_NOTES
from bench.record import KEY, Provenance


def device_name(device_type: str) -> str:
    """The card's name, read through NVML where possible so the parent process never initialises
    CUDA.

    On CPU, the processor model, thread count and the vector instructions ATen's kernels use (AVX2,
    AVX512, SVE256, …): each changes the figures, so each is part of the name that keys stored
    records (another machine measures afresh instead of reusing them). One "AMD EPYC" name hid two
    kinds of VM: bf16 steps took 0.6 times the fp32 step on one, with AVX-512, and 15 times on the
    other, without."""
    if device_type != "cuda":
        return (
            f"{cpu_model()}, {torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}"
        )
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        if isinstance(name, bytes):
            return name.decode()
        return name
    except Exception:  # noqa: BLE001  NVML absent or unusable: ask torch instead
        return torch.cuda.get_device_name(0)


# "native" or "emulated": stands for the CPU's own answer (tests, on any machine)
CPU_BF16 = "BENCH_CPU_BF16"
EMULATED_BF16 = (
    "this CPU has no native bf16 (AVX-512 bf16 or Arm's, for oneDNN): its kernels emulate it, "
    "about 10 times slower than fp32 (ResNet-50's step 10.3 s against 0.95 s), so its figures "
    "would describe nothing a user would run; measure bf16 on a GPU, or on a CPU that has it"
)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively: oneDNN's test, as torch's CPU kernels and inductor
    ask it (no public API says it); ``BENCH_CPU_BF16`` overrides it, so that tests hold on both
    kinds of CPU."""
    if (value := os.environ.get(CPU_BF16)) in ("native", "emulated"):
        return value == "native"
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def git_revision(root: Path | None = None) -> str:
    root = root or Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        # Records and reports under results/ are the harness's own output: a sweep that follows
        # another would otherwise call its code dirty. What decides the figures is everything else.
        status = [
            "git",
            KEY.status,
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":(exclude)results",
        ]
        dirty = subprocess.run(
            status, cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev.stdout.strip() + ("-dirty" if dirty else "")


# Packages whose code a run may execute and whose version can change its figures: a model's
# implementation (torchvision, transformers, timm), a technique's (peft, torchao, bitsandbytes,
# accelerate).
PACKAGES = ("torchvision", "transformers", "timm", "peft", "accelerate", "torchao", "bitsandbytes")


def runtime_provenance(device: torch.device) -> Provenance:
    """Read inside the run's process, after the run, so it reflects the settings the run used."""
    out = Provenance(
        torch_version=torch.__version__,
        packages=package_versions(),
        python_version=platform.python_version(),
        hostname=platform.node(),
        cpu_threads=torch.get_num_threads(),
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        package_notes=dict(IMPORT_NOTES) or None,
    )
    if device.type == "cuda":
        out |= Provenance(
            cuda_version=torch.version.cuda,
            cudnn_version=torch.backends.cudnn.version(),
            driver_version=_driver_version(),
            allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            # TF32 silently changes fp32 baselines on Ampere and newer, so every CUDA record says.
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            # what the driver leaves CUDA of the card, less than its maker's figure: --card's memory
            device_memory_bytes=torch.cuda.get_device_properties(device).total_memory,
        )
    return out


def package_versions() -> dict[str, str]:
    """The versions of the PACKAGES this process imported: those the run used, and no others."""
    out = {}
    for name in PACKAGES:
        if name in sys.modules:
            try:
                out[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:  # imported from a path, not installed
                out[name] = getattr(sys.modules[name], "__version__", "unknown")
    return out


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(version, bytes):
            return version.decode()
        return version
    except Exception:  # noqa: BLE001
        return None
