"""Session fixtures: tiny random models (built from configs in tests/fixtures) and their ONNX exports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hetero_spec.draft.export import export_draft
from tests.fixtures.tiny_models import build_model

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def no_observed_goodput(monkeypatch):
    """The Engine re-places itself from the goodput it observes (wall clock): that would make any test with
    runtime.mode auto depend on the machine's load. Tests inject observations instead (test_placement.py)."""
    from hetero_spec import Engine

    monkeypatch.setattr(Engine, "OBSERVE_MIN_TOKENS", 10**9)


@pytest.fixture
def slow_draft(monkeypatch):
    """slow_draft(ms): draft worker processes started from now on take ms longer per drafted token
    (tests/fixtures/slowdraft/sitecustomize.py, on their PYTHONPATH)."""
    here = Path(__file__).resolve().parent

    def slow(ms: float) -> None:
        monkeypatch.setenv("HETERO_SPEC_TEST_DRAFT_DELAY_MS", str(ms))
        paths = [str(here / "fixtures" / "slowdraft"), str(here.parent), os.environ.get("PYTHONPATH", "")]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))

    return slow


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", autouse=True)
def export_cache(tmp_path_factory):
    """Exports made on first use (target.backend onnx with a Hugging Face directory) go to a session folder,
    never to the user's ~/.cache; tests that check the cache itself point HETERO_SPEC_CACHE elsewhere."""
    old = os.environ.get("HETERO_SPEC_CACHE")
    os.environ["HETERO_SPEC_CACHE"] = str(tmp_path_factory.mktemp("export-cache"))
    yield Path(os.environ["HETERO_SPEC_CACHE"])
    if old is None:
        os.environ.pop("HETERO_SPEC_CACHE", None)
    else:
        os.environ["HETERO_SPEC_CACHE"] = old


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_draft_int4(models_dir) -> Path:
    """The demo draft (models/draft) exported at int4 with block 128, as configs/gpu-target.yaml's draft and
    scripts/gpu_wheels.sh build it (exports are not tracked: they are rebuilt from the checkpoint)."""
    return export_draft(ROOT / "models" / "draft", models_dir / "demo-draft-int4", "int4", quiet=True,
                        block_size=128)


@pytest.fixture(scope="session")
def llama_target(models_dir) -> Path:
    return build_model("llama_gqa", models_dir / "llama", seed=1)


@pytest.fixture(scope="session")
def chat_target(llama_target, models_dir) -> Path:
    """The tiny target with a chat template in its tokenizer_config.json."""
    import json
    import shutil

    out = models_dir / "llama-chat"
    if not out.exists():
        shutil.copytree(llama_target, out)
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                                "{% if add_generation_prompt %}<assistant>{% endif %}")
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def llama_copy_onnx(models_dir, llama_target) -> Path:
    """The target itself exported to ONNX: a draft that agrees with the target everywhere."""
    return export_draft(llama_target, models_dir / "llama-copy-onnx", "fp32", quiet=True)


@pytest.fixture(scope="session")
def llama_random_onnx(models_dir) -> Path:
    """An unrelated random draft with the same tokenizer: almost nothing is accepted."""
    hf = build_model("llama_gqa", models_dir / "llama-other", seed=7, num_hidden_layers=1)
    return export_draft(hf, models_dir / "llama-other-onnx", "fp32", quiet=True)


@pytest.fixture(scope="session")
def qwen2_target(models_dir) -> Path:
    return build_model("qwen2", models_dir / "qwen2", seed=3)


@pytest.fixture(scope="session")
def qwen2_copy_onnx(models_dir, qwen2_target) -> Path:
    return export_draft(qwen2_target, models_dir / "qwen2-copy-onnx", "fp32", quiet=True)


@pytest.fixture(scope="session")
def gpt2_target(models_dir) -> Path:
    return build_model("gpt2", models_dir / "gpt2", seed=5)


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int,
              eos_token_id: int | list[int] | None = None) -> list[int]:
    """Reference: transformers generate(do_sample=False) on the target alone, fp32; generated ids only."""
    from transformers import AutoModelForCausalLM

    model = _hf_model(model_dir)
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


_HF_CACHE: dict[Path, object] = {}


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_CACHE[model_dir]
