"""`hetero-spec bench`: this engine side by side with its peers on the same prompts and machine.

harness (settings, registry, interleaving, pairing, report), systems (ours and transformers), ort_genai,
llama_cpp (the peers), prompts, memory, cli (`hetero-spec bench`), load and soak (`hetero-spec load`, `soak`).
"""

from .harness import SYSTEMS, BenchContext, BenchError, BenchSettings, RunOutput, System, register, run_bench
from . import systems, ort_genai, llama_cpp  # noqa: E402,F401,I001  (registers the systems, in run order)

__all__ = ["SYSTEMS", "BenchContext", "BenchError", "BenchSettings", "RunOutput", "System", "register", "run_bench"]
