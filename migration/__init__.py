"""Live migration of running requests and their KV blocks between instances."""
