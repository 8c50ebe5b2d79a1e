"""The Hugging Face Trainer integration."""
