"""The node agent: plays the kubelet's DRA part for one Node of the local cluster.

There is no kubelet in rota's local cluster. This agent does what the kubelet would do for
DRA and a little more: it registers the driver through the real registration socket,
watches pods bound to its Node, calls ``NodePrepareResources`` on the driver's real DRA
socket with the pod's claims, applies the CDI spec's environment to the pod's engine,
starts the engine as a local process on its own loopback IP, reports the pod Running, and
on deletion stops the engine and calls ``NodeUnprepareResources``.
"""
