"""``stagemesh doctor``: find the known pitfalls of a node or a cluster and say how to fix each.

- ``facts``: gathers what a node is (versions, addresses, ports, resources); side effects.
- ``checks``: pure rules from facts to findings.
- ``command``: the CLI, locally or on every node of a Ray cluster.
"""
