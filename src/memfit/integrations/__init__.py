"""Framework adapters: translate Lightning / Hugging Face state in, apply the plan out."""
