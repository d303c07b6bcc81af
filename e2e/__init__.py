"""A local Kubernetes made of real binaries, the node agent, and the engine simulator."""
