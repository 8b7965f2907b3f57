"""Instance agents: the process that wraps one engine instance and makes it a member of a kvherd fleet."""

