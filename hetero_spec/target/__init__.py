"""Verifier backends behind one interface (base.py); backends.py picks one. This package imports neither."""
