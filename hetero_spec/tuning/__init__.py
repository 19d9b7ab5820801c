"""Measured costs -> decisions: the speculation on/off gate (and, later, gamma and batch size)."""

from .gate import CostGate

__all__ = ["CostGate"]
