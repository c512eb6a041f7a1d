"""The device's side of the engine: the model runner, its persistent decode batch, the jitted steps, the sampler,
compilation, the KV cache and multi-host replay."""
