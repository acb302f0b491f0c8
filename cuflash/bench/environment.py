"""What this machine offers the benchmarks: CuPy (optional), torch, the GPU, the versions."""

import platform
import subprocess
import time

import numpy as np

from .. import __version__

try:  # CuPy is optional: without it (or without a GPU) the command only says so.
    import cupy
except ImportError:  # pragma: no cover - exercised only without CuPy
    cupy = None


def _cuda_version(number):
    """CUDA's integer version (e.g. 13000) as "13.0"."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _module_version(name):
    try:
        module = __import__(name)
    except ImportError:
        return None
    return getattr(module, "__version__", None)


def _driver_release():
    """The NVIDIA driver release from nvidia-smi, or None."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def environment(torch):
    """Versions of every package involved and the GPU's name and sizes."""
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"]
    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuflash": __version__,
        "numpy": np.__version__,
        "cupy": cupy.__version__,
        "ml_dtypes": _module_version("ml_dtypes"),
        "matplotlib": _module_version("matplotlib"),
        "tqdm": _module_version("tqdm"),
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver_api": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "driver": _driver_release(),
        "nvrtc": ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "compute_capability": device.compute_capability,
        "multiprocessors": props["multiProcessorCount"],
        "l2_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
        "torch": None,
        "torch_cuda": None,
        "cudnn": None,
    }
    if torch is not None:
        env.update(
            torch=torch.__version__,
            torch_cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def import_torch(enabled):
    """``(torch, note)``: the module when it can run SDPA on this GPU, else None and why."""
    if not enabled:
        return None, "disabled by --no-torch"
    try:
        import torch
        from torch.nn.attention import sdpa_kernel  # noqa: F401 - torch >= 2.3 needed
    except ImportError as exc:
        return None, f"not importable: {exc}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA GPU"
    return torch, "ok"


def gpu_unavailable_reason():
    """Why no GPU can be used, or None when CuPy sees one."""
    if cupy is None:
        return "CuPy is not installed"
    try:
        return None if cupy.is_available() else "cupy.is_available() is False"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means no GPU
        return f"CUDA failed: {exc}"
