"""What an ONNX export holds and what a generated token reads of it: the size of its weights, the bytes one decode
step reads (every weight, but only one row of a table that is only gathered from: an embedding), and which large
tensors stayed in fp32. A decode step is bound by memory bandwidth on a CPU, so bytes per token predict its cost.
Reads the graph with `onnx` (no weights loaded: external data sizes come from the graph's records)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_GATHERS = {"Gather", "GatherBlockQuantized"}
_FLOATS = {"FLOAT": 4, "FLOAT16": 2, "BFLOAT16": 2}


@dataclass
class WeightReport:
    total_bytes: int = 0
    per_token_bytes: int = 0
    #: (name, bytes, dtype) of float tensors of 1 MB or more, largest first: what quantization left out
    float_tensors: list[tuple[str, int, str]] = field(default_factory=list)
    #: tables read one row per token (embeddings), name -> (bytes, rows)
    gathered: dict[str, tuple[int, int]] = field(default_factory=dict)

    def line(self) -> str:
        gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
        left = ", ".join(f"{n} {gb(b)} {d.lower()}" for n, b, d in self.float_tensors[:4]) or "none"
        return (f"weights {gb(self.total_bytes)}; a generated token reads about {gb(self.per_token_bytes)} "
                f"(embedding tables: one row); float tensors over 1 MB: {left}")


def _nbytes(init) -> int:
    return next((int(e.value) for e in init.external_data if e.key == "length"), len(init.raw_data))


def weight_report(export_dir: Path) -> WeightReport:
    """The export's weights (model.onnx and its external data) and what one decode step reads of them."""
    import onnx
    model = onnx.load(str(Path(export_dir) / "model.onnx"), load_external_data=False)
    consumers: dict[str, set[str]] = defaultdict(set)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].add(node.op_type)
    rep = WeightReport()
    for init in model.graph.initializer:
        n, dtype = _nbytes(init), onnx.TensorProto.DataType.Name(init.data_type)
        rep.total_bytes += n
        if consumers[init.name] and consumers[init.name] <= _GATHERS and init.dims:
            rows = int(init.dims[0])
            rep.gathered[init.name] = (n, rows)
            rep.per_token_bytes += n // max(1, rows)
        else:
            rep.per_token_bytes += n
        if dtype in _FLOATS and n >= 1_000_000:
            rep.float_tensors.append((init.name, n, dtype))
    rep.float_tensors.sort(key=lambda t: -t[1])
    return rep
