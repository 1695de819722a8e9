"""Policy models: load a local Hugging Face directory or build the embedded tiny one.

What this is: tokenizer and model construction, hashing, and the short
supervised warm start that gives the built-in model a starting policy.

What this is not: rollout or training (plugins do those), and never a download.
"""
