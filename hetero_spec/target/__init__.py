"""Verifier backends behind one interface (`base.Verifier`: new_state, prefill, verify, rollback):
`verifier.TargetModel` (PyTorch; the CUDA path) and `onnx_backend.OnnxTarget` (ONNX Runtime; never
imports torch); `backends.py` picks one (`target.backend: torch | onnx | auto`). Import the module you
need: this package imports neither."""
