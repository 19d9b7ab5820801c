"""Measured costs -> decisions: cost model, profile store, placement, and the one speculation controller."""
