"""``stagemesh soak``: endurance under load and faults (``command``), its clients, faults and verdict."""
