"""gateway.openai."""
