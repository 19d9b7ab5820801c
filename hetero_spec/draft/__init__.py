"""Proposers. Nothing in here imports torch: the draft side runs under ONNX Runtime or plain Python."""

from .base import Draft, Proposer
from .ngram import NgramProposer

__all__ = ["Draft", "Proposer", "NgramProposer"]
