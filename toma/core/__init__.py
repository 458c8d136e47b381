"""The retry engine and what it stands on: steps, out-of-memory detection, caches of sizes per call site,
call sites themselves, argument checks, the size file, the sizing-policy interface and the agreement of ranks."""
