"""Trace-driven simulator: the production scheduler, policies and engine core on a virtual clock."""

