"""hetero_spec: heterogeneous, hardware-aware speculative decoding. A draft proposes tokens, the target verifies
them; greedy output is identical to the target alone and sampled output keeps the target's distribution."""

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationOutput", "__version__"]


def __getattr__(name: str):
    # Lazy: `import hetero_spec` stays cheap (no torch) for the CLI's --help and the draft worker.
    if name in ("Engine", "GenerationOutput"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)
