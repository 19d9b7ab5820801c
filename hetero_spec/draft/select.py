"""Per-round draft selection's settings (`draft.candidates`, docs/features-tuning.md); the choice is
tuning/controller.StrategyChooser's, run by draft/source.SelectingSource."""

from __future__ import annotations

#: strategies that cost microseconds: asked every round, chosen only when they found a match
LOOKUPS = ("ngram", "corpus")
#: draft.prompt_window auto, in process, next to a lookup: the model reads the prompt's last 32 tokens (measured:
#: docs/benchmarks.md, "Draft selection's settings")
PROMPT_WINDOW = 32


def prompt_window(setting: int | str | None, candidates: list[str], layout: str) -> int | None:
    """OnnxDrafter.prompt_window for draft.prompt_window = setting: `auto` is PROMPT_WINDOW in process when a lookup
    drafts next to a model, else None (a worker drafts every round on its own core, its prefill beside the target's)."""
    if setting != "auto":
        return setting
    lookup = any(c in LOOKUPS for c in candidates) and any(c not in LOOKUPS for c in candidates)
    return PROMPT_WINDOW if lookup and layout == "in_process" else None
