"""The ops a step runs, per platform: Kernels (kernels.py) picks each from the platform of the mesh the step is
compiled for; attention.py and ops.py dispatch; triton/, tpu/ and native/ hold the kernels, reference.py the jnp
oracle."""
