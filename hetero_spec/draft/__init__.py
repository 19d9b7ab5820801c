"""Proposers. Nothing in here imports torch: the draft side runs under ONNX Runtime or plain Python."""
