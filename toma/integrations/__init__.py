"""toma inside the frameworks people train with: each integration is a module of its own that imports its
framework (`toma.integrations.lightning`, `toma.integrations.accelerate`, ...); `import toma` imports none of
them."""
