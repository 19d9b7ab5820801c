"""Demo model pair (target + distilled draft) for hetero_spec: training, evaluation, corpus helpers."""
