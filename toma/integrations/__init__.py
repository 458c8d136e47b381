"""toma inside the training frameworks people already use: `toma.integrations.transformers` (the Hugging Face
Trainer), `toma.integrations.lightning` and `toma.integrations.accelerate`.

Each lives in a module of its own and imports its framework only when that module is imported: `import toma`
and `import toma.integrations` never import transformers, lightning or accelerate.
"""
