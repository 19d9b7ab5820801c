"""The PyTorch verifier. Imports torch; never onnxruntime."""

from .verifier import TargetModel, TargetState

__all__ = ["TargetModel", "TargetState"]
