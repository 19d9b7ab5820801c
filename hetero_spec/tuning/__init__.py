"""Measured costs -> decisions: the cost model, the profile store, placement, and the one speculation
controller (controller.py)."""
