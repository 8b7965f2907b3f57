"""kvherd: a KV-cache-aware cluster scheduler for LLM serving fleets.

This package holds only the command-line entry point; the system lives in the top-level packages
`instance_agent`, `scheduler`, `policies`, `migration` and `simulator`.
"""


__version__ = "0.1.0"
