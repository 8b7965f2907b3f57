"""Global scheduler: a pure core (cluster state, prefix index, dispatch) and the reverse proxy around it."""

from kvherd.compiled import select_form

select_form()  # the compiled or the plain form of the hot modules (kvherd/compiled.py)
