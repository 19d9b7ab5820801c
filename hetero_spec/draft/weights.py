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
        size = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
        left = ", ".join(f"{n} {size(b)} {d.lower()}" for n, b, d in self.float_tensors[:4]) or "none"
        return (f"weights {size(self.total_bytes)}; a generated token reads about {size(self.per_token_bytes)} "
                f"(embedding tables: one row); float tensors over 1 MB: {left}")


def weight_report(export_dir: Path) -> WeightReport:
    """The export's weights (model.onnx and its external data) and what one decode step reads of them."""
    import onnx
    model = onnx.load(str(Path(export_dir) / "model.onnx"), load_external_data=False)
    consumers: dict[str, set[str]] = defaultdict(set)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].add(node.op_type)
    report = WeightReport()
    for init in model.graph.initializer:
        # external data: its recorded length (nothing is loaded)
        size = next((int(e.value) for e in init.external_data if e.key == "length"), len(init.raw_data))
        dtype = onnx.TensorProto.DataType.Name(init.data_type)
        report.total_bytes += size
        table = consumers[init.name] and consumers[init.name] <= _GATHERS and init.dims  # only gathered from
        if table:
            report.gathered[init.name] = (size, int(init.dims[0]))
        report.per_token_bytes += size // max(1, int(init.dims[0])) if table else size
        if dtype in _FLOATS and size >= 1_000_000:
            report.float_tensors.append((init.name, size, dtype))
    report.float_tensors.sort(key=lambda t: -t[1])
    return report
