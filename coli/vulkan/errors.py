"""Errors of the Vulkan backend (importable without the ``vulkan`` binding)."""
from __future__ import annotations


class VulkanError(RuntimeError):
    """A Vulkan call failed (the message names the call and the VkResult)."""


class DeviceLost(VulkanError):
    """The device was lost (a failed submit or fence wait, a timeout, or ``COLI_VK_FAULT``).

    The caller recomputes the batch's pairs on the CPU and turns the tier off; the device takes no
    more work after this.
    """


class BudgetExceeded(VulkanError):
    """An upload would take the device's expert memory past its budget (``Device.budget_bytes``)."""
