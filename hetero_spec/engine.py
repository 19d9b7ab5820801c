"""The public, embeddable API.

    from hetero_spec import Engine
    with Engine.from_config("configs/cpu-demo.yaml", overrides={"speculation.gamma": 4}) as eng:
        out = eng.generate("def parse(", max_new_tokens=64, temperature=0.0, seed=0)
        print(out.text, out.token_ids, out.stats)
        for piece in eng.stream("def parse(", max_new_tokens=64):
            print(piece, end="")
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config, check_paths, load_config
from .errors import ConfigError, RequestError, VocabMismatchError
from .metrics import Stats
from .sampling import SamplingParams
from .scheduler import Request, decode

log = logging.getLogger("hetero_spec")


@dataclass
class GenerationOutput:
    """Result of `Engine.generate`. token_ids holds the generated ids only (not the prompt)."""

    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats}


def _tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_vocab(target_dir: Path, draft_dir: Path) -> None:
    """The draft must emit the same token ids as the target: same tokenizer vocabulary.

    Logit widths may differ (transformers pads some vocabularies); what matters is the ids the
    tokenizers define. A draft directory without a tokenizer.json cannot be checked and is trusted.
    """
    tv, dv = _tokenizer_vocab(target_dir), _tokenizer_vocab(draft_dir)
    if tv is None or dv is None:
        return
    if len(tv) != len(dv):
        raise VocabMismatchError(f"draft vocabulary has {len(dv)} tokens ({draft_dir}) but the target's has "
                                 f"{len(tv)} ({target_dir}): the draft must use the target's tokenizer")
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise VocabMismatchError(f"draft and target vocabularies both have {len(tv)} tokens but assign "
                                 f"different ids (e.g. {diff}): the draft must use the target's tokenizer")


class Engine:
    """Speculative decoding engine: a PyTorch target verifying proposals of a draft."""

    def __init__(self, config: Config):
        check_paths(config)
        self.config = config
        log.info("resolved config (%s): %s", config.source, config.model_dump_json())
        from .target.verifier import TargetModel

        t = config.target
        self.runtime = None
        self._cpu_plan = None
        threads = t.threads
        if config.runtime.mode == "two_process":
            from .runtime.engine_side import CpuPlan

            self._cpu_plan = CpuPlan(config)
            threads = self._cpu_plan.threads
        self.target = TargetModel(t.model, device=t.device, dtype=t.dtype, threads=threads,
                                  max_context=t.max_context)
        self.tokenizer = self.target.tokenizer
        if config.runtime.mode == "two_process":
            from .runtime.engine_side import PipelinedRuntime

            self.proposer = None
            self._check_draft(config)
            self.runtime = PipelinedRuntime(config, self.target.vocab_width)
        else:
            self.proposer = self._make_proposer(config)

    @classmethod
    def from_config(cls, config: str | Path | Config | dict,
                    overrides: dict[str, Any] | None = None) -> Engine:
        """Build from a YAML path, a Config, or a raw dict; overrides are dotted keys ("speculation.gamma")."""
        if isinstance(config, Config):
            if overrides:
                from .config import build_config

                config = build_config(config.model_dump(mode="json"), source=config.source, overrides=overrides)
            return cls(config)
        if isinstance(config, dict):
            from .config import build_config

            return cls(build_config(config, overrides=overrides))
        return cls(load_config(config, overrides=overrides))

    def _make_proposer(self, config: Config):
        d = config.draft
        if d.kind == "none":
            return None
        if d.kind == "ngram":
            from .draft.ngram import NgramProposer

            if d.ngram.min_n > d.ngram.max_n:
                raise ConfigError(config.source, "draft.ngram.min_n", d.ngram.min_n,
                                  f"must be <= draft.ngram.max_n ({d.ngram.max_n})")
            return NgramProposer(max_n=d.ngram.max_n, min_n=d.ngram.min_n)
        from .draft.onnx_drafter import OnnxDrafter

        self._check_draft(config)
        return OnnxDrafter(d.model, providers=d.providers, threads=d.threads,
                           vocab_width=self.target.vocab_width)

    @staticmethod
    def _check_draft(config: Config) -> None:
        from .draft.onnx_drafter import check_providers

        check_providers(config.draft.providers, source=config.source)
        check_vocab(config.target.model, config.draft.model)

    def _decode(self, req: Request, stats: Stats):
        if self.runtime is not None:
            return self.runtime.decode(self.target, req, stats)
        return decode(self.target, self.proposer, req, stats)

    def health(self) -> dict:
        """Real probes: the target answers a one-token forward; the draft worker answers a ping."""
        import time

        t = time.perf_counter()
        state = self.target.new_state()
        self.target.forward(state, [0])
        out = {"target": "ok", "target_step_ms": round((time.perf_counter() - t) * 1e3, 3)}
        if self.runtime is not None:
            out.update(self.runtime.sup.health())
        else:
            out["draft"] = "in_process" if self.proposer is not None else "none"
        return out

    # -- requests ----------------------------------------------------------------------------------
    def _request(self, prompt: str | list[int], max_new_tokens: int | None, temperature: float | None,
                 top_k: int | None, top_p: float | None, seed: int | None,
                 stop_token_ids: list[int] | None, gamma: int | None) -> Request:
        g = self.config.generation
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"the target directory {self.target.model_dir} has no tokenizer; "
                                   "pass the prompt as a list of token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.target.vocab_width]
            if bad:
                raise RequestError(f"prompt token ids out of range [0, {self.target.vocab_width}): {bad[:5]}")
        temperature = g.temperature if temperature is None else float(temperature)
        top_p = g.top_p if top_p is None else float(top_p)
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        seed = seed if seed is not None else g.seed if g.seed is not None else secrets.randbits(48)
        params = SamplingParams(temperature=temperature, top_k=g.top_k if top_k is None else int(top_k),
                                top_p=top_p, seed=int(seed))
        stops = set(self.target.eos_token_ids) | set(g.stop_token_ids) | set(stop_token_ids or [])
        return Request(prompt_ids=prompt_ids,
                       max_new_tokens=g.max_new_tokens if max_new_tokens is None else int(max_new_tokens),
                       params=params, gamma=gamma or self.config.speculation.gamma,
                       stop_ids=frozenset(stops))

    def _decode_text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def generate(self, prompt: str | list[int], max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop_token_ids: list[int] | None = None,
                 gamma: int | None = None) -> GenerationOutput:
        """Generate a completion. Unset arguments come from the config's `generation` section."""
        req = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, gamma)
        stats = Stats()
        ids: list[int] = []
        for chunk in self._decode(req, stats):
            ids.extend(chunk)
        return GenerationOutput(text=self._decode_text(ids), token_ids=ids, stats=stats.to_dict(),
                                finish_reason=stats.finish_reason)

    def stream(self, prompt: str | list[int], max_new_tokens: int | None = None,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, stop_token_ids: list[int] | None = None,
               gamma: int | None = None, stats: Stats | None = None) -> Iterator[str]:
        """Yield text pieces as rounds commit tokens. Pass a Stats object to read the statistics after."""
        req = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, gamma)
        stats = stats if stats is not None else Stats()
        ids: list[int] = []
        # Incremental detokenization (as vLLM does): decode only from prefix_off, so each round costs
        # O(round) instead of re-decoding the whole output. ids[prefix_off:read_off] has been emitted.
        prefix_off = read_off = 0
        for chunk in self._decode(req, stats):
            ids.extend(chunk)
            prefix = self._decode_text(ids[prefix_off:read_off])
            text = self._decode_text(ids[prefix_off:])
            if text.endswith("\ufffd") and not stats.finish_reason:
                continue  # an incomplete UTF-8 sequence: wait for the next tokens
            if len(text) > len(prefix):
                yield text[len(prefix):]
            prefix_off, read_off = read_off, len(ids)

    def close(self) -> None:
        """Release the draft; in two_process mode shut the worker down cleanly (no orphans)."""
        if self.proposer is not None:
            self.proposer.close()
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        if self._cpu_plan is not None:
            self._cpu_plan.restore()
            self._cpu_plan = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
