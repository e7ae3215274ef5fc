"""A generator rank: its loop, its pure bookkeeping, how many prompts it asks for, LoRA adapters it merges."""
