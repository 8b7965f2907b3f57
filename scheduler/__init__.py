"""Global scheduler: a pure core (cluster state, prefix index, dispatch) and the reverse proxy around it."""

