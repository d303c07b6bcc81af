"""What rota does not ship: the harness that builds clusters and nodes, the simulators, the
benchmarks, the campaigns and the release tools, one subpackage per purpose (README.md)."""
