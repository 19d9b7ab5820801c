"""Per-round draft selection (`draft.candidates`): its settings here; the choice itself is the speculation
controller's (tuning/controller.StrategyChooser). Each round drafts with the strategy whose predicted goodput is
highest, from its own measured acceptance and cost per token; `none` (the target alone) when no strategy pays.

For strategy s with per-token acceptance a_s and draft cost d_s per token, the cost model
(tuning/cost_model.py) gives the best gamma g_s and goodput E(a_s, g_s) / R_s(g_s), where R_s is the round
time of the layout s drafts in: in process (g d_s + V(g), drafting and verifying in turn), or two-process
for the worker's model draft (drafting overlapped with verification); the target alone yields 1 / V(0).
Every strategy is tried in turn until each has `explore_rounds` rounds; after that a strategy not chosen
for the controller's probe period gets one round again (its acceptance may have changed: an n-gram lookup wins on
repetitive text, a model on novel text); a re-probe that gets nothing accepted doubles the period, as a gamma
probe does. The n-gram lookup costs microseconds, so it is asked every round
first, and it competes only in rounds where it found a match (its acceptance is measured on those): elsewhere
the choice is among the others.

`draft/source.SelectingSource` runs it over draft sources, in either layout: in process over local sources
(the onnx model, the n-gram lookup), in two processes over the worker's model stream and a local n-gram lookup
(the worker keeps drafting whatever is chosen).
"""

from __future__ import annotations


LOOKUPS = ("ngram",)  # strategies that cost microseconds: asked every round, chosen only when they found a match
#: a model candidate feeds at most this many of the tokens other strategies committed since it last drafted
#: (OnnxDrafter.catchup_skip). Measured on the repetitive bench, in process, 6 prompts x 5 repeats, selection
#: against the n-gram lookup alone: feeding all 0.94-0.97x, the last 2 0.95x, the last 4 0.98x.
CATCHUP_SKIP = 4
#: draft.prompt_window: auto, in process, with a lookup among the candidates: the model reads the prompt's last
#: 32 tokens. Its prefill of a 170-token prompt cost 46 ms of the 80 ms it drafted per request on the
#: repetitive bench (the int8 draft: prefill is 0.27 ms a token), for about 11 model rounds; the draft's run
#: of agreement with the target fell 4 % (5.94 -> 5.71 tokens, offline over those prompts).
PROMPT_WINDOW = 32


def prompt_window(setting: int | str | None, candidates: list[str], layout: str) -> int | None:
    """The model draft's prompt window (OnnxDrafter.prompt_window) for draft.prompt_window = setting: an int
    or None as given; `auto` is PROMPT_WINDOW in process when a lookup drafts next to a model, else None (two
    processes: the worker drafts every round on its own core, its prefill beside the target's)."""
    if setting != "auto":
        return setting
    lookup = any(c in LOOKUPS for c in candidates) and any(c not in LOOKUPS for c in candidates)
    return PROMPT_WINDOW if lookup and layout == "in_process" else None
