"""Trace-driven simulator: the production scheduler, policies and engine core on a virtual clock."""

from kvherd.compiled import select_form

select_form()  # the compiled or the plain form of the hot modules (kvherd/compiled.py)
