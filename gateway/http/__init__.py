"""gateway.http."""
