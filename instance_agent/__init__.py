"""Instance agents: the process that wraps one engine instance and makes it a member of a kvherd fleet."""

from kvherd.compiled import select_form

select_form()  # the compiled or the plain form of the hot modules (kvherd/compiled.py)
