"""gateway.parsing."""
