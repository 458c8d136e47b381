"""Memory levers: ways to trade compute for memory below one row (activation checkpointing; on CUDA, activation
offload to host memory), each a small object that applies itself to a model and is removed again, leaving the model
as the user gave it."""
