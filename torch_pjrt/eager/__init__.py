"""Execution modes: strict eager (per-op programs), launch-blocking eager, and room for fused."""
