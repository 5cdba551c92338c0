"""Scheduler side: which tier holds which block. Imports no torch."""
