"""The demo-pair training script on a tiny corpus (a few steps), not the full training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SNIPPETS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(os.path.basename(arg))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print('even', i)\n    else:\n        print('odd', i)\n",
]


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    for i in range(40):
        sub = corpus / f"pkg{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(SNIPPETS[i % 3] * (1 + i % 5) + f"\nVALUE_{i} = {i}\n")
    (corpus / "bad.py").write_bytes(b"\xff\xfe not utf-8 \xc3\x28")
    return corpus


def test_tiny_training_run_writes_loadable_pair(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "models.train", "--out", str(out), "--corpus-dir", str(_corpus(tmp_path)),
           "--max-steps", "3", "--tiny", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("target", "draft"):
        d = out / name
        assert (d / "tokenizer.json").is_file() and (d / "config.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d)
        ids = tok.encode("def add(a, b):")
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        assert logits.shape[-1] >= len(tok) and torch.isfinite(logits).all()
    t_vocab = json.loads((out / "target" / "tokenizer.json").read_text())["model"]["vocab"]
    d_vocab = json.loads((out / "draft" / "tokenizer.json").read_text())["model"]["vocab"]
    assert t_vocab == d_vocab  # same tokenizer for the pair
