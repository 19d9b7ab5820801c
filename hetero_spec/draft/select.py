"""Per-round draft selection's settings (`draft.candidates`, docs/features-tuning.md); the choice is
tuning/controller.StrategyChooser's, run by draft/source.SelectingSource."""

from __future__ import annotations

#: strategies that cost microseconds: asked every round, chosen only when they found a match
LOOKUPS = ("ngram", "corpus")
#: a model candidate feeds at most this many of the tokens other strategies committed since it last drafted
#: (OnnxDrafter.catchup_skip). Measured on the repetitive bench, in process, 6 prompts x 5 repeats, selection
#: against the n-gram lookup alone: feeding all 0.94-0.97x, the last 2 0.95x, the last 4 0.98x.
CATCHUP_SKIP = 4
#: draft.prompt_window auto, in process, next to a lookup: the model reads the prompt's last 32 tokens. Its prefill
#: of a 170-token prompt cost 46 ms of the 80 ms it drafted per request (repetitive bench, int8 draft, ~11 model
#: rounds); its run of agreement with the target fell 4 % (5.94 -> 5.71 tokens, offline over those prompts).
PROMPT_WINDOW = 32


def prompt_window(setting: int | str | None, candidates: list[str], layout: str) -> int | None:
    """OnnxDrafter.prompt_window for draft.prompt_window = setting: `auto` is PROMPT_WINDOW in process when a lookup
    drafts next to a model, else None (a worker drafts every round on its own core, its prefill beside the target's)."""
    if setting != "auto":
        return setting
    lookup = any(c in LOOKUPS for c in candidates) and any(c not in LOOKUPS for c in candidates)
    return PROMPT_WINDOW if lookup and layout == "in_process" else None
