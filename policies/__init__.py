"""Policy plug-in API: read-only views, dispatch and migration policies, and the built-ins."""
