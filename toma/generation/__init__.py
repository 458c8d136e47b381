"""Generation that adapts to memory mid-decode: `toma.generate(model, **generate_kwargs)` (`toma.generation.generate`),
the live batch split where the KV cache outgrows memory and every part continued from where it was
(`toma.generation.kv_cache` cuts and crops the caches)."""
