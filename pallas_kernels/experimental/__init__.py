"""Kernel prototypes not wired into any dispatcher (pallas_kernels.dispatch never picks them)."""
