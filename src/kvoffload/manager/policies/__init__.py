"""Eviction policies behind one small interface (see ``base.py``)."""
