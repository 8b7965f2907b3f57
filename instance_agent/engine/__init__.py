"""kvherd's built-in paged-attention engine.

The torch-free core (request state, block hashing, block manager, batch scheduler, KV events) is
importable without torch and is reused by the simulator and the scheduler. The torch parts (model,
paged attention, model runner, sampler, `LLMEngine`) are imported only when an engine actually runs.
"""
