"""The model: loading (packaged GGUF, local folders, Hub ids), the one per-family adapter, the pruned modules and
checkpoint classes, next-token NLL, counting and freezing parameters."""
