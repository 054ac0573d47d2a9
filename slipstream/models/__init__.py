"""Model implementations, looked up by the `architectures` name of a checkpoint."""
