"""The mesh's coordinator: plans a mesh, places and launches its stages with Ray, supervises them and publishes
their state (``coordinator.mesh`` wires these jobs together)."""
