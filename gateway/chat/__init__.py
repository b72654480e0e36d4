"""gateway.chat."""
