"""The Vulkan backend: resident experts on any GPU a Vulkan driver can see (docs/vulkan.md).

``open_device(label, ...)`` is the only entry point; importing ``coli.vulkan`` does not import the
``vulkan`` binding (which dlopens the loader). On any failure it prints one line
``[VK] <label>: <why>, running on the CPU`` to stderr and returns None, so the run goes on on the CPU.
"""
from __future__ import annotations

import os
import sys

from coli.base.errors import ColiError

from .errors import BudgetExceeded, DeviceLost, VulkanError

__all__ = ["open_device", "device_flag", "DeviceLost", "VulkanError", "BudgetExceeded"]


class _FFIProxy:
    """The binding's cffi FFI with ``dlopen`` of the loader redirected (``COLI_VK_LOADER``)."""

    def __init__(self, ffi, loader: str):
        self._ffi, self._loader = ffi, loader

    def dlopen(self, name, *a):
        return self._ffi.dlopen(self._loader if isinstance(name, str) and "vulkan" in name else name, *a)

    def __getattr__(self, k):
        return getattr(self._ffi, k)


def _load_binding():
    """Import the ``vulkan`` binding; ``COLI_VK_LOADER`` names another loader library to open."""
    from coli.base.settings import get

    loader = get("COLI_VK_LOADER")
    if loader and "vulkan" not in sys.modules:
        import ctypes
        import importlib.util
        try:
            ctypes.CDLL(loader)
        except OSError as e:
            raise OSError(f"no Vulkan loader ({loader}: {e})") from None
        # the binding dlopens 'libvulkan.so.1' by name at import: give its FFI a redirected dlopen
        origin = importlib.util.find_spec("vulkan").origin
        spec = importlib.util.spec_from_file_location(
            "vulkan._vulkancache", os.path.join(os.path.dirname(origin), "_vulkancache.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.ffi = _FFIProxy(mod.ffi, loader)
        sys.modules["vulkan._vulkancache"] = mod
    try:
        import vulkan  # noqa: F401
    except OSError as e:
        raise OSError(f"no Vulkan loader ({loader or 'libvulkan.so.1'}: {str(e).splitlines()[0]})") from None


def device_flag(device: str | None) -> tuple[str | None, int | None]:
    """``--device`` as ``(device, index)``: None, "cpu", "vulkan" with index None, or "vulkan:N" as ("vulkan", N).
    ColiError naming the flag for anything else."""
    if device is not None and device.startswith("vulkan:"):
        if not device[7:].isdigit():
            raise ColiError(f"--device {device}: N is a device number (vulkan:0, vulkan:1, ...)")
        return "vulkan", int(device[7:])
    if device not in (None, "cpu", "vulkan"):
        raise ColiError(f"--device: '{device}' (cpu, vulkan or vulkan:N)")
    return device, None


def open_device(label: str, *, budget=None, block_bytes: int | None = None, staging: bool | None = None,
                device_index: int | None = None, quiet: bool = False, index_name: str | None = None,
                required: bool = False):
    """Open the Vulkan device for ``label`` (the model's name); ``Device`` or None.

    budget: the device memory the experts may take, from the caller: bytes, or a callable that takes the
    device's figures ``{"name", "kind", "heap_bytes", "budget_free"}`` and returns ``(bytes, words of the
    rule)`` (the engine passes the tier's rule, scheduler.tier_policy.budget_bytes; docs/vulkan.md); None: the
    whole heap. block_bytes: device-memory block size (256 MiB). staging: force the
    staging path (COLI_VK_STAGING=1). device_index: like COLI_VK_DEV; index_name: what set it, for the failure
    line (the CLI's ``--device vulkan:N``; default the variable's name). On success prints
    ``[VK] <label>: <device line>`` unless quiet; on failure prints ``[VK] <label>: <why>, running on
    the CPU`` and returns None, or with ``required`` (a device the user asked for) raises ``VulkanError(why)``
    and prints nothing. With no index, a software rasterizer (llvmpipe) is not chosen unless
    ``COLI_VK_SOFTWARE=1``.
    """
    try:
        from . import shaders as S
        for k, t in S.builds():     # before the loader: a missing .spv is reported on any machine
            if not (S.shader_dir() / S.spv_name(k, t)).exists():
                raise FileNotFoundError(f"missing shaders ({S.shader_dir() / S.spv_name(k, t)})")
        _load_binding()
        from .device import Device  # loads the vulkan binding: only when a device is opened
        kw = {} if block_bytes is None else {"block_bytes": block_bytes}
        dev = Device(label, budget=budget, staging=staging, device_index=device_index, index_name=index_name, **kw)
    except ColiError:       # a bad setting (COLI_VK_ZERO_COPY=...): the user's error, one line, not a fallback
        raise
    except Exception as e:  # any failure: the CPU runs instead (or the caller's error, when required)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if required:
            raise VulkanError(why) from None
        print(f"[VK] {label}: {why}, running on the CPU", file=sys.stderr, flush=True)
        return None
    if not quiet:
        print(f"[VK] {label}: {dev.describe()}", file=sys.stderr, flush=True)
    return dev
