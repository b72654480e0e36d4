"""gateway.mesh."""
