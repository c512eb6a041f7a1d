"""Ferry's engine: LLMEngine (schedule, execute, update), LLM, EngineConfig and the output side; the scheduler's
core, the device worker and the entry points are its subpackages."""
