"""Ferry's models: the Flax transformer and its config, the mesh and tensor-parallel shardings, the paged KV
cache's metadata, loading (checkpoints/, tokenizers/); default/ holds the embedded demo model."""
