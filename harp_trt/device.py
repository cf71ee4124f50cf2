"""Where a PyTorch stage runs: ``--device``, ``--dtype``, ``--device-map`` and the sequential mode.

``auto`` picks CUDA when torch sees a GPU. The default dtype is bfloat16 on CUDA and float32 on the
CPU. Results differ between device kinds and dtypes, so both enter artifact keys; where the layers
sit (one device, a device map, or loaded one at a time) does not change the numbers and does not.

A model runs *sequentially* (one decoder layer resident at a time, read from the safetensors files)
when asked to, or when its weights at the compute dtype would not fit in the memory left on the
device (``choose_sequential``)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import option
from .errors import ConfigError

__all__ = ["Placement", "PlacementRequest", "resolve_placement", "DTYPE_NAMES", "available_memory", "choose_sequential",
           "torch_dtype"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
# weights may take this share of free memory before the sequential mode is chosen
IN_MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class PlacementRequest:
    """What a user asks for (the flags of every command that runs PyTorch), checked against this
    host by :func:`resolve_placement`."""

    device: str = option("auto", help="auto | cpu | cuda | cuda:N (default auto: CUDA when torch sees a GPU)")
    dtype: str | None = option(None, help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, float32 on CPU)")
    device_map: str | None = option(None, help="spread a resident model over all visible GPUs (and CPU) with "
                                               "accelerate: auto | balanced | sequential")
    sequential: bool | None = option(None, help="load one decoder layer at a time from the safetensors files "
                                                "(chosen automatically when the weights exceed the free memory)")


@dataclass(frozen=True)
class Placement:
    """A resolved placement. ``kind`` (cpu | cuda) and ``dtype`` enter artifact keys."""

    device: str                    # "cpu", "cuda", "cuda:1"
    dtype: str                     # float32 | bfloat16 | float16
    device_map: str | None = None  # accelerate device map (auto, balanced, ...), or None
    sequential: bool | None = None  # None: decide from the model size (choose_sequential)

    @property
    def kind(self) -> str:
        return self.device.split(":")[0]

    def torch_device(self):
        import torch

        return torch.device(self.device)

    def describe(self, sequential: bool) -> str:
        where = f"device_map={self.device_map}" if self.device_map else self.device
        return f"{where}, {self.dtype}, {'sequential (one layer resident)' if sequential else 'in memory'}"


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def resolve_placement(device: str | None = "auto", dtype: str | None = None, device_map: str | None = None,
                      sequential: bool | None = None) -> Placement:
    """Check a user's device / dtype / device-map request against this host; raise ``ConfigError``
    (exit 2, one line plus a hint) for what cannot run here."""
    import torch

    spec = (device or "auto").strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = spec.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ConfigError(f"unknown device {device!r}; valid: auto, cpu, cuda, cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device} asked for a GPU but torch sees none "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})",
                              "use --device cpu (or auto), or install a CUDA build of torch on a GPU host")
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            raise ConfigError(f"--device {device}: only {n} GPU(s) visible (cuda:0..cuda:{n - 1})")
    if dtype is None:
        dtype = "bfloat16" if kind == "cuda" else "float32"
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    check_dtype(kind, dtype, bf16_supported=(torch.cuda.is_bf16_supported() if kind == "cuda" else True))
    if device_map is not None:
        if device_map not in DEVICE_MAPS:
            raise ConfigError(f"--device-map must be one of {', '.join(DEVICE_MAPS)}, got {device_map!r}")
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise ConfigError("--device-map needs the accelerate package", "pip install accelerate") from None
        if sequential:
            raise ConfigError("--device-map and --sequential exclude each other",
                              "a device map spreads a resident model over devices; --sequential loads one layer at a time")
    return Placement(spec, dtype, device_map, sequential)


def check_dtype(kind: str, dtype: str, bf16_supported: bool) -> None:
    if kind == "cuda" and dtype == "bfloat16" and not bf16_supported:
        raise ConfigError("this GPU cannot run bfloat16 (needs compute capability 8.0 or newer)",
                          "pass --dtype float16")


def available_memory(device: str) -> int:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    from harp_trt.memory import host_available

    return host_available()


def choose_sequential(placement: Placement, weight_bytes: int) -> bool:
    """The explicit choice, else: sequential when the weights at the compute dtype exceed
    ``IN_MEMORY_SHARE`` of the memory free on the device. A device map never runs sequentially."""
    if placement.device_map is not None:
        return False
    if placement.sequential is not None:
        return placement.sequential
    return weight_bytes > IN_MEMORY_SHARE * available_memory(placement.device)
