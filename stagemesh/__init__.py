"""stagemesh: serve language models across a handful of Macs; ``stagemesh.cli`` is the command line and
``stagemesh_core`` the contracts every service shares."""
