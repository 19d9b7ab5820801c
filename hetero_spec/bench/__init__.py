"""`hetero-spec bench`, `load` and `soak`: harness (settings, registry, interleaving, pairing, report), systems
(ours), peers (transformers, ORT GenAI, llama.cpp), prompts, memory, cli; load and soak."""

from .harness import SYSTEMS, BenchContext, BenchError, BenchSettings, RunOutput, System, run_bench
from . import systems, peers  # noqa: E402,F401,I001  (registers the systems, in run order)

__all__ = ["SYSTEMS", "BenchContext", "BenchError", "BenchSettings", "RunOutput", "System", "run_bench"]
