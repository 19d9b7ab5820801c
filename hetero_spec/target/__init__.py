"""Verifier backends behind one interface (new_state, prefill, verify, rollback, forward):
`verifier.TargetModel` (PyTorch; the CUDA path) and `onnx_backend.OnnxTarget` (ONNX Runtime; never
imports torch). Import the module you need: this package imports neither."""
